"""The vocabulary CE kernels (C > 512; kernels/vocab_ce.py and, picked by LaunchConfig.vocab_path,
kernels/vocab_ce_vocab_chunks.py and kernels/vocab_ce_row_chunks.py): long rows, out-of-range class ids,
the chunks, against the float64 reference."""

import pytest
import torch
import triton
import triton.language as tl

import erase_triton.kernels.plan as klh
from erase_triton.kernels.common import combine_lse
from erase_triton import LaunchConfig, fused_local_head
from head_checks import DTYPES, check, make, poison  # noqa: F401  (poison: the autouse fixture)


def test_ce_vocab_large_rows(device):
    # several row tiles and vocabulary tiles, with ignored rows
    check("ce", 781, 130, 1000, torch.float32, False, 1.0, device)


@pytest.mark.parametrize("path", ["recompute", "vocab_chunks", "row_chunks"])
def test_ce_fp16_gradients_of_many_rows_do_not_underflow(path, device):
    # the mean over 1638 counted rows of a near-uniform softmax over 8192 classes: dz ~ 1 / (C N) = 7e-8,
    # a single fp16 subnormal step (6e-8). The kernels keep the 16-bit dz unscaled and apply 1 / N to the
    # fp32 sums; scaled first, such a dz is rounded by up to 50% (flushed to 0 below 3e-8: the H200's
    # 50257-class test had grad_h off by 2.7%).
    cfg = LaunchConfig(vocab_path=path, chunk_size=4096 if path != "recompute" else None)
    check("ce", 2048, 16, 8192, torch.float16, False, None, device, config=cfg)


# The small-vocabulary CE kernel (64 < C <= 512): odd and full class counts, every dtype,
# ignored rows, with and without bias, and row groups (split-K phase B + phase R) where N is
# long enough (1100 rows under the interpreter: 9 row blocks of 128, 2 groups at occupancy 1/2).
# 16-bit inputs with C <= 256 take the grad_h^T = W^T dz^T form (GH_T), the others dz W.
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy sees the NaN made
@pytest.mark.parametrize("C,kind", [(5, "dense"), (100, "small"), (1000, "vocab"), (1000, "vocab_chunks"),
                                    (1000, "row_chunks"), (1000, "cublas"), (1000, "cublas_vocab_chunks")])
def test_ce_class_id_out_of_range_poisons_with_nan(C, kind, device):
    # ids >= C and negative ids other than ignore_index: no out-of-bounds read (the vocabulary kernel
    # gathers W[t]), a NaN loss and NaN gradients where the row reaches, every other row as before
    h, w, b, y = make("ce", 40, 32, C, torch.float32, True, device)
    bad = torch.tensor([3, 7])
    y_bad = y.clone()
    y_bad[3], y_bad[7] = C, -1
    klh._PLANS.clear()
    cfg = LaunchConfig(vocab_path=kind if kind.endswith("_chunks") or kind.startswith("cublas") else
                       "recompute" if kind == "vocab" else None)
    out = fused_local_head(h, w, b, y_bad, loss="ce", backend="triton", config=cfg)
    assert {p.kind for p in klh._PLANS.values()} == {kind}
    assert torch.isnan(out.loss)
    assert torch.isnan(out.grad_h[bad]).all() and torch.isnan(out.grad_weight).any() and torch.isnan(out.grad_bias).any()
    good = torch.ones(40, dtype=torch.bool)
    good[bad] = False
    y_ok = y_bad.clone()
    y_ok[bad] = 0  # in range: the same rows count toward the mean
    ok = fused_local_head(h, w, b, y_ok, loss="ce", backend="triton", config=cfg)
    torch.testing.assert_close(out.grad_h[good.to(h.device)], ok.grad_h[good.to(h.device)])
    with pytest.raises(IndexError):  # the PyTorch backend stops, as F.cross_entropy does
        fused_local_head(h.cpu(), w.cpu(), b.cpu(), y_bad.cpu(), loss="ce", backend="torch")


# The chunked vocabulary paths (LaunchConfig.vocab_path; kernels/vocab_ce_vocab_chunks.py and
# kernels/vocab_ce_row_chunks.py): one chunk and several, the last one short (vocab_chunks: 1000 columns =
# 3 x 256 + 232; row_chunks: 300 rows = 2 x 128 + 44), one row tile and several, every dtype, with and
# without bias, the ReLU, sum reduction, one program (occupancy 1/32: every stage barrier with a single
# program) and several vocabulary splits in vocab_chunks' stage L (occupancy 1, 4 programs).
CHUNKED = [  # N, D, C, dtype, bias, occupancy, chunk_size (vocab_chunks, row_chunks), activation, reduction
    (63, 50, 1000, "fp32", True, None, (None, None), None, "mean"),
    (300, 130, 1000, "fp32", False, 0.5, (256, 128), None, "mean"),
    (300, 40, 1000, "bf16", True, 1 / 32, (384, 200), "relu", "mean"),
    (63, 50, 1000, "fp16", True, None, (128, 128), None, "sum"),
    (1, 50, 1000, "bf16", False, None, (256, 128), None, "mean"),
    (130, 33, 513, "fp32", True, 1 / 32, (256, 128), "relu", "sum"),
]
PATHS = ("vocab_chunks", "row_chunks")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("N,D,C,dt,bias,occupancy,chunks,activation,reduction", CHUNKED,
                         ids=[f"N{c[0]}-D{c[1]}-C{c[2]}-{c[3]}-chunks{c[6][0]}-{c[6][1]}" for c in CHUNKED])
def test_chunked_vocab_matches_reference(path, N, D, C, dt, bias, occupancy, chunks, activation, reduction, device):
    klh._PLANS.clear()
    cfg = LaunchConfig(occupancy=occupancy, vocab_path=path, chunk_size=chunks[PATHS.index(path)])
    check("ce", N, D, C, DTYPES[dt], bias, None, device, reduction=reduction, config=cfg, activation=activation)
    assert {p.kind for p in klh._PLANS.values()} == {path}


@pytest.mark.parametrize("path,chunk", [("vocab_chunks", 256), ("row_chunks", 64)])
def test_chunked_vocab_with_many_row_tiles(path, chunk, device):
    # 16-row tiles: 38 row tiles, more than one load of grad_b partials (vocab_chunks) and several
    # row tiles a chunk (row_chunks)
    check("ce", 600, 20, 600, torch.float32, True, None, device,
          config=LaunchConfig(block_n=16, vocab_path=path, chunk_size=chunk))


@pytest.mark.parametrize("path,chunk", [("vocab_chunks", 256), ("row_chunks", 128)])
def test_chunked_vocab_is_bitwise_reproducible_and_close_to_the_recompute_path(path, chunk, device):
    h, w, b, y = make("ce", 300, 40, 1000, torch.float32, True, device)
    cfg = LaunchConfig(vocab_path=path, chunk_size=chunk)
    a = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=cfg)
    again = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=cfg)
    other = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=LaunchConfig(vocab_path="recompute"))
    for x, z, r in zip(a, again, other):
        assert torch.equal(x, z)
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-6)


def test_chunk_size_rule():
    cfg = LaunchConfig()
    rule = klh.chunk_size_for
    # (4096, 512, 32000) bf16: a 16 MiB scratch; vocab_chunks: 2048 columns (16 chunks), row_chunks: 256 rows
    assert rule("vocab_chunks", 4096, 32000, 512, 2, 2, 128, cfg) == 2048
    assert rule("row_chunks", 4096, 32000, 512, 2, 2, 128, cfg) == 256
    # (4096, 4096, 128256) bf16: a quarter of grad_W's 1.05 GB, balanced over the chunks
    c = rule("vocab_chunks", 4096, 128256, 4096, 2, 2, 128, cfg)
    assert c % 128 == 0 and -(-128256 // c) == 5
    assert rule("row_chunks", 4096, 128256, 4096, 2, 2, 128, cfg) == 1024
    # small heads: one chunk of the whole (padded) extent; an explicit size rounded up to the tile
    assert rule("vocab_chunks", 63, 1000, 50, 4, 4, 128, cfg) == 1024
    assert rule("row_chunks", 63, 1000, 50, 4, 4, 128, cfg) == 128
    assert rule("vocab_chunks", 63, 1000, 50, 4, 4, 128, LaunchConfig(chunk_size=300)) == 384
    # row_chunks' floor (enough grad_h tiles for the grid: 132 programs, 4 D tiles) wins over the budget
    assert rule("row_chunks", 4096, 32000, 512, 2, 2, 128, cfg, least=33 * 128) == 4096
    assert rule("row_chunks", 8192, 32000, 512, 2, 2, 128, cfg, least=33 * 128) == 4096  # two even chunks
    assert rule("row_chunks", 4096, 1000, 50, 4, 4, 128, LaunchConfig(chunk_size=300)) == 384
    # cublas: rows in 64s, at least CUBLAS_MIN_ROWS (1024) a chunk, a scratch of up to 3/8 of grad_W, not evened
    # out (1536 + 1536 + 1024 rows, not 3 x 1408); all rows where fewer
    kw = dict(least=klh.CUBLAS_MIN_ROWS, share=klh.CUBLAS_SCRATCH_SHARE, even=False)
    t = klh.CUBLAS_ROW_TILE
    assert rule("cublas", 4096, 128256, 4096, 2, 2, t, cfg, **kw) == 1536
    assert rule("cublas", 4096, 128256, 4096, 2, 2, t, cfg, least=kw["least"], share=3 / 8) == 1408  # (evened out)
    assert rule("cublas", 4096, 32000, 512, 2, 2, t, cfg, **kw) == 1024  # the floor, above 16 MiB's 256 rows
    assert rule("cublas", 300, 1000, 40, 2, 2, t, cfg, **kw) == 320
    assert rule("cublas", 4096, 32000, 512, 2, 2, t, LaunchConfig(chunk_size=100), **kw) == 128
    # cublas_vocab_chunks: classes in 128s, a scratch of N x chunk up to 7/8 of grad_W (N x 3456: 27 of 31 MiB),
    # evened out (10 x 3200, not 9 x 3456 + 896)
    kv = dict(share=klh.CUBLAS_VOCAB_SCRATCH_SHARE)
    t = klh.CUBLAS_COLUMN_TILE
    assert rule("cublas_vocab_chunks", 4096, 32000, 512, 2, 2, t, cfg, **kv) == 3200
    assert rule("cublas_vocab_chunks", 4096, 32000, 512, 2, 2, t, cfg, **kv, even=False) == 3456
    assert rule("cublas_vocab_chunks", 4096, 50257, 1024, 2, 2, t, cfg, **kv) == 10112  # (5 chunks, the last 9809)
    assert rule("cublas_vocab_chunks", 300, 1000, 40, 2, 2, t, cfg, **kv) == 1024  # (16 MiB: every class)
    assert rule("cublas_vocab_chunks", 300, 1000, 40, 2, 2, t, LaunchConfig(chunk_size=100), **kv) == 128


@pytest.mark.parametrize("kw,match", [(dict(vocab_path="fast"), "vocab_path must be one of"),
                                      (dict(chunk_size=0), "chunk_size must be a positive int"),
                                      (dict(chunk_size=True), "chunk_size must be a positive int"),
                                      (dict(chunk_size=2.5), "chunk_size must be a positive int")])
def test_vocab_options_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        LaunchConfig(**kw)


@pytest.mark.parametrize("path,chunk", [("vocab_chunks", 256), ("row_chunks", 128), ("vocab_chunks", None)])
def test_chunked_vocab_stays_inside_its_workspace(path, chunk, monkeypatch, device):
    # the host's workspace size (plan.prepare_launch) against the kernel's layout: a guard of sentinels
    # right after the floats the launch asked for must come back untouched
    guard = []

    def floats(self, n):
        big = torch.full((n + 4096,), 12345.0, device=self.ctr.device)
        guard.append(big[n:])
        return big[:n]

    monkeypatch.setattr(klh._Workspace, "floats", floats)
    klh._workspace(torch.device(device)).buf = torch.empty(0, device=device)
    h, w, b, y = make("ce", 300, 40, 1000, torch.bfloat16, True, device)
    fused_local_head(h, w, b, y, loss="ce", backend="triton", config=LaunchConfig(vocab_path=path, chunk_size=chunk))
    assert len(guard) == 1 and (guard[0] == 12345.0).all()


@triton.jit
def _combine_lse_kernel(m_ptr, s_ptr, out_ptr, stride, n_parts, n_rows, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < n_rows
    tl.store(out_ptr + o_r, combine_lse(m_ptr, s_ptr, stride, n_parts, o_r, m_r, BLOCK_R, BLOCK_P), mask=m_r)


@pytest.mark.parametrize("n_parts", [1, 4, 10])
def test_combine_lse_over_several_loads(n_parts, device):
    # kernels/common.combine_lse (both chunked kernels' lse): parts in loads of BLOCK_P = 4, combined online,
    # including empty parts (max -inf, sum 0: a vocabulary split past C) and large maxima
    g = torch.Generator().manual_seed(n_parts)
    m = torch.randn(n_parts, 24, generator=g) * 30
    s = torch.rand(n_parts, 24, generator=g) * 5 + 1
    if n_parts > 1:
        m[-1, :], s[-1, :] = float("-inf"), 0.0
    out = torch.empty(20, device=device)
    _combine_lse_kernel[(1,)](m.to(device), s.to(device), out, 24, n_parts, 20, BLOCK_R=32, BLOCK_P=4)
    ref = torch.logsumexp(m.double() + s.double().log(), dim=0)[:20]
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-6, atol=1e-5)


# vocab_path="cublas" (kernels/vocab_ce_cublas.py): cuBLAS GEMMs (torch.mm; on the CPU, torch's own) around one
# Triton kernel a chunk. The chunked paths' cases in bf16 and fp32 (fp16 is refused: below), one chunk and several
# (rows rounded up to 64: 300 rows in chunks of 128 = 2 x 128 + 44), one row and sum reduction; with occupancy,
# which it does not use.
CUBLAS = [c for c in CHUNKED if c[3] != "fp16"] + [(300, 40, 1000, "bf16", True, None, (None, 64), None, "sum")]


@pytest.mark.parametrize("path", ["cublas", "cublas_vocab_chunks"])
@pytest.mark.parametrize("N,D,C,dt,bias,occupancy,chunks,activation,reduction", CUBLAS,
                         ids=[f"N{c[0]}-D{c[1]}-C{c[2]}-{c[3]}-chunks{c[6][0]}-{c[6][1]}-{c[8]}" for c in CUBLAS])
def test_cublas_vocab_matches_reference(path, N, D, C, dt, bias, occupancy, chunks, activation, reduction, device):
    # "cublas" takes the rows chunk size of the cases, "cublas_vocab_chunks" the columns one (classes in 512s: one
    # chunk of 1000, or 512 + 488)
    klh._PLANS.clear()
    cfg = LaunchConfig(occupancy=occupancy, vocab_path=path, chunk_size=chunks[path == "cublas"])
    check("ce", N, D, C, DTYPES[dt], bias, None, device, reduction=reduction, config=cfg, activation=activation)
    assert {p.kind for p in klh._PLANS.values()} == {path}


def test_kernel_launch_passes_constexprs_in_the_kernels_order(device):
    # the direct CUDA launch hands a kernel its constexprs positionally after the other arguments: in the kernel's
    # parameter order whatever the order of the launch keywords; keywords that are not its last parameters, or
    # arguments too few or too many for the rest, are refused when the launch is made (on the CPU too)
    from erase_triton.kernels.direct import KernelLaunch
    from erase_triton.kernels.vocab_ce_cublas_vocab_chunks import chunk_lse_kernel as k
    cx = dict(GROUP=8, BLOCK=64, LAST=True, FIRST=False, MEAN=True, HAS_BIAS=False, num_warps=1)
    assert KernelLaunch(k, 3, cx, arity=12).tail == (False, True, False, True, 64, 8)
    with pytest.raises(ValueError, match="arguments"):
        KernelLaunch(k, 3, cx, arity=11)
    with pytest.raises(ValueError, match="last parameters"):
        KernelLaunch(k, 3, dict(cx, STRIDE=4))


def _spy_cublas_kernels(monkeypatch):
    # every Triton launch of the cublas path, direct (CUDA) or not: (kernel name, grid, BLOCK constexpr)
    from erase_triton.kernels.direct import KernelLaunch

    launched = []
    real = KernelLaunch.__call__

    def spy(self, stream, *args):
        grid = self.grid[:1] if self.grid[1:] == (1, 1) else self.grid
        launched.append((self.name, grid, self.cx.get("BLOCK")))
        return real(self, stream, *args)

    monkeypatch.setattr(KernelLaunch, "__call__", spy)
    return launched


def test_cublas_vocab_takes_chunks_of_rows(monkeypatch, device):
    # 300 rows in chunks of 128: three lse launches of 128, 128 and 44 programs, each followed by dz over the
    # chunk's rows in blocks of DZ_BLOCK_C columns
    from erase_triton.kernels.vocab_ce_cublas import DZ_BLOCK_C

    launched = _spy_cublas_kernels(monkeypatch)
    check("ce", 300, 40, 1000, torch.float32, True, None, device, config=LaunchConfig(vocab_path="cublas", chunk_size=100))
    dz_grid = (-(-1000 // DZ_BLOCK_C),)
    assert [(n, g) for n, g, _ in launched] == [("mean_scale_kernel", (1,))] + [
        ("row_lse_kernel", (128,)), ("dz_colsum_kernel", dz_grid)] * 2 + [("row_lse_kernel", (44,)), ("dz_colsum_kernel", dz_grid)]


@pytest.mark.parametrize("bias", [True, False])
def test_cublas_vocab_chunks_launches(bias, monkeypatch, device):
    # 1000 classes in chunks of 512: the lse kernel over 512 then 488 classes (one program a row), dz over each
    # chunk in blocks of columns x DZ_SPLITS blocks of rows (without a bias: in blocks of rows along them), and
    # one launch for grad_b (blocks of COLSUM_BLOCK classes) and the loss
    from erase_triton.kernels.vocab_ce_cublas_vocab_chunks import COLSUM_BLOCK, DZ_SPLITS, VDZ_BAND_TILE, VDZ_TILE

    launched = _spy_cublas_kernels(monkeypatch)
    check("ce", 300, 40, 1000, torch.float32, bias, None, device,
          config=LaunchConfig(vocab_path="cublas_vocab_chunks", chunk_size=500))
    rows_per = -(-(-(-300 // DZ_SPLITS)) // VDZ_TILE[0]) * VDZ_TILE[0]
    splits = -(-300 // rows_per)
    dz = lambda n: (("dz_split_kernel", (-(-n // VDZ_TILE[1]), splits, 1)) if bias  # noqa: E731
                    else ("dz_band_kernel", (-(-300 // VDZ_BAND_TILE[0]),)))
    assert [(n, g) for n, g, _ in launched] == [
        ("mean_scale_kernel", (1,)), ("chunk_lse_kernel", (300,)), ("chunk_lse_kernel", (300,)), dz(488), dz(512),
        ("colsum_loss_kernel", (-(-1000 // COLSUM_BLOCK) if bias else 1,))]


@pytest.mark.parametrize("bias", [True, False])
def test_cublas_vocab_chunks_pipelined_dz(bias, monkeypatch, device):
    # DZ_STAGES > 0: the dz kernels' loops as tl.range(num_stages=...) (rows short of a block, a last chunk of 488
    # classes); the reference's results (tests/test_gpu.py: bitwise the plain loop's on a GPU)
    from erase_triton.kernels import vocab_ce_cublas_vocab_chunks as vc
    monkeypatch.setattr(vc, "DZ_STAGES", 2)
    check("ce", 300, 40, 1000, torch.float32, bias, None, device,
          config=LaunchConfig(vocab_path="cublas_vocab_chunks", chunk_size=500))


@pytest.mark.parametrize("accumulate", [False, True])
def test_cublas_vocab_chunks_keeps_two_chunks_of_logits(accumulate, monkeypatch, device):
    # 1000 classes in 128s: a first chunk of 104 (what is left over), then 7 whole. Pass 2 starts with the chunks
    # whose logits stay from pass 1: the last (the scratch) and, unless grad_W is added to, the one before it
    # (in grad_W's first rows): 8 + 6 logits GEMMs, not 8 + 7. grad_W poisoned (NaN) before a call that writes
    # it; every output the reference's.
    from erase_triton.functional import local_head_into
    from erase_triton.kernels.vocab_ce_cublas_vocab_chunks import CublasVocabLaunch
    from erase_triton import reference
    N, D, C = 64, 40, 1000
    launch = CublasVocabLaunch(N, C, 128, True, -100, False, accumulate, True, torch.device(device), D=D)
    assert launch.kept == 2 - accumulate
    h, w, b, y = make("ce", N, D, C, torch.float32, True, device)
    gw = torch.full_like(w, 0.0 if accumulate else float("nan"))
    gb = torch.zeros_like(b)
    logits = []
    real = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, c, **kw: (kw.get("out") is not None and kw["out"].shape[0] == N
                                                          and kw["out"].shape[1] != D and logits.append(1))
                        or real(a, c, **kw))
    loss, grad_h = local_head_into(h, w, b, y, loss="ce", reduction="mean", ignore_index=-100, backend="triton",
                                   config=LaunchConfig(vocab_path="cublas_vocab_chunks", chunk_size=128),
                                   grad_weight=gw, grad_bias=gb, accumulate=accumulate)
    monkeypatch.setattr(torch, "mm", real)
    assert len(logits) == 8 + 7 - (not accumulate)
    ref = reference.local_head(h.double(), w.double(), b.double(), y, loss="ce")
    for got, want in ((loss, ref.loss), (grad_h, ref.grad_h), (gw, ref.grad_weight), (gb, ref.grad_bias)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("C", [1000, 1025])
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
@pytest.mark.parametrize("bias,two_pass", [(False, None), (True, None), (False, True), (True, True)])
def test_cublas_softmax_kernel_both_forms(C, dt, bias, two_pass, monkeypatch, device):
    # Without a bias, the row held in one block and read once (softmax_dz_kernel); with one, or two_pass=True, the
    # lse a row in blocks (row_lse_kernel), then dz and the column sums (dz_colsum_kernel). block_v=256 with
    # C = 1025: 5 blocks, the last with one column (31 of its 32 groups of lanes only padding: max -inf, sum 0);
    # with ignored rows
    from erase_triton.kernels.vocab_ce_cublas import LSE_BLOCK

    launched = _spy_cublas_kernels(monkeypatch)
    check("ce", 70, 24, C, DTYPES[dt], bias, None, device,
          config=LaunchConfig(vocab_path="cublas", two_pass=two_pass, block_v=256 if two_pass else None))
    c2 = triton.next_power_of_2(C)
    scale = ("mean_scale_kernel", 1024)
    if not bias and not two_pass:  # (its loss summed by one more launch)
        assert {(n, b) for n, _, b in launched} == {scale, ("softmax_dz_kernel", c2), ("loss_total_kernel", None)}
    else:
        assert {(n, b) for n, _, b in launched} == {scale, ("row_lse_kernel", 256 if two_pass else min(LSE_BLOCK, c2)),
                                                    ("dz_colsum_kernel", None)}


def test_cublas_one_read_form_refuses_a_bias_or_a_long_row(device):
    h, w, b, y = make("ce", 40, 32, 1000, torch.float32, True, device)
    with pytest.raises(ValueError, match="two_pass=False .* got C=1000, bias=True"):
        fused_local_head(h, w, b, y, loss="ce", backend="triton", config=LaunchConfig(vocab_path="cublas", two_pass=False))
    h2, w2, _, y2 = make("ce", 4, 8, 40000, torch.float32, False, device)
    with pytest.raises(ValueError, match="two_pass=False .* got C=40000, bias=False"):
        fused_local_head(h2, w2, None, y2, loss="ce", backend="triton", config=LaunchConfig(vocab_path="cublas", two_pass=False))
    out = fused_local_head(h, w, None, y, loss="ce", backend="triton", config=LaunchConfig(vocab_path="cublas", two_pass=False))
    ref = fused_local_head(h, w, None, y, loss="ce", backend="torch")
    torch.testing.assert_close(out.grad_h, ref.grad_h, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("path,chunk", [("cublas", 128), ("cublas_vocab_chunks", 512)])
def test_cublas_vocab_is_bitwise_reproducible(path, chunk, device):
    h, w, b, y = make("ce", 300, 40, 1000, torch.bfloat16, True, device)
    cfg = LaunchConfig(vocab_path=path, chunk_size=chunk)
    a = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=cfg)
    again = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=cfg)
    for x, z in zip(a, again):
        assert torch.equal(x, z)


@pytest.mark.parametrize("path", ["cublas", "cublas_vocab_chunks", "cublas_in_place"])
@pytest.mark.parametrize("what,match", [("fp16", "takes bf16 or fp32 h"), ("weight", "needs weight in h's dtype"),
                                        ("bias", "needs bias in h's dtype"), ("precision", "fp32_precision does not apply")])
def test_cublas_vocab_refuses_what_it_cannot_run(path, what, match, device):
    h, w, b, y = make("ce", 40, 32, 1000, torch.float32, True, device)
    cfg = LaunchConfig(vocab_path=path)
    if what == "fp16":
        h, w, b = h.half(), w.half(), b.half()
    elif what == "weight":
        h, b = h.bfloat16(), b.bfloat16()
    elif what == "bias":
        h, w = h.bfloat16(), w.bfloat16()
    else:
        cfg = LaunchConfig(vocab_path=path, fp32_precision="ieee")
    with pytest.raises(ValueError, match=match) as err:
        fused_local_head(h, w, b, y, loss="ce", backend="triton", config=cfg)
    assert f"vocab_path={path!r}" in str(err.value)


@pytest.mark.parametrize("path", ["cublas", "cublas_vocab_chunks", "cublas_in_place"])
def test_cublas_launch_takes_h_and_target_in_their_own_shape(path, device):
    # A repeated CUDA call takes the fast path, which calls the prepared launch with h [B, T, D] and the
    # target [B, T] as the caller gave them (the Triton launches read only pointers; torch.mm needs [N, D]).
    # Planned for the [N, D] view, called like the fast path: the same loss and gradients, grad_h shaped like h.
    from erase_triton.kernels.plan import prepare_launch

    torch.manual_seed(0)
    D = 160 if path == "cublas_in_place" else 24  # (in place: the 150 rows' logits fit in grad_W)
    h = torch.randn(3, 50, D, device=device)
    w, b = torch.randn(1000, D, device=device) * 0.2, torch.randn(1000, device=device) * 0.1
    y = torch.randint(0, 1000, (3, 50), device=device)
    gw, gb = torch.empty_like(w), torch.empty_like(b)
    hl = prepare_launch(h.reshape(-1, D), w, b, y.reshape(-1), "ce", "mean", -100,
                        LaunchConfig(vocab_path=path, chunk_size=64), gw, gb, False)
    loss, gh = hl(h, w, b, y, gw, gb)
    ref = fused_local_head(h, w, b, y, loss="ce", backend="torch")
    assert gh.shape == h.shape
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)
    for got, want in ((gh, ref.grad_h), (gw, ref.grad_weight), (gb, ref.grad_bias)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("path, chunk", [("cublas", 64), ("cublas_vocab_chunks", 512), ("cublas_in_place", 512)])
def test_cublas_paths_round_as_eager_pytorch_but_cublas_grad_w(path, chunk, device):
    # Four chunks of rows, eight of classes (in place: 128 rows, eight blocks of classes written over the logits
    # from the last). Every gradient within 1.1x the relative error of eager PyTorch's
    # bf16 head (Linear, cross_entropy, autograd: dz rounded to bf16 before its GEMMs, each output rounded
    # once), except `cublas`' grad_W, added to in bf16 once a chunk of rows (1.3x here;
    # docs/tuning.md#vocabulary-ce-paths). head_checks' 2x-plus-0.8% rule passes a grad_h summed in bf16 over
    # the chunks of classes (1.6x); this does not
    import torch.nn.functional as F

    from erase_triton import reference

    N, D = (128, 128) if path == "cublas_in_place" else (256, 64)
    h, w, b, y = make("ce", N, D, 4096, torch.bfloat16, True, device)
    out = fused_local_head(h, w, b, y, loss="ce", backend="triton",
                           config=LaunchConfig(vocab_path=path, chunk_size=chunk))
    leaves = [t.detach().requires_grad_(True) for t in (h, w, b)]
    eager = torch.autograd.grad(F.cross_entropy(F.linear(*leaves), y), leaves)
    ref = reference.local_head(h.double(), w.double(), b.double(), y, loss="ce")
    err = lambda o, r: ((o.double() - r.double()).norm() / r.double().norm()).item()  # noqa: E731
    for what, e in zip(("grad_h", "grad_weight", "grad_bias"), eager):
        ratio = err(getattr(out, what), getattr(ref, what)) / err(e, getattr(ref, what))
        most = 2.0 if (path, what) == ("cublas", "grad_weight") else 1.1
        assert ratio <= most, f"{path} {what}: {ratio:.3f}x eager PyTorch's error, more than {most}"
        if (path, what) == ("cublas", "grad_weight"):
            assert ratio > 1.1, f"cublas grad_W: {ratio:.3f}x eager's error: the chunks' roundings are gone?"


# (N, D, C, dtype, bias, block of classes, reduction, activation): N <= D. Blocks of 256 over 1000 classes (the
# last short, the logits of classes 256-999 in grad_W's memory); C below one block (all of them in the scratch);
# rows not a multiple of the kernels' 64; one row; a sum; relu
IN_PLACE = [(64, 96, 1000, "fp32", True, 256, "mean", None), (64, 64, 700, "bf16", False, None, "mean", None),
            (50, 80, 1300, "bf16", True, 512, "sum", "relu"), (1, 16, 600, "fp32", True, 128, "mean", None),
            (100, 100, 2000, "fp32", False, 64, "mean", "relu")]


@pytest.mark.parametrize("N,D,C,dt,bias,block,reduction,activation", IN_PLACE,
                         ids=[f"N{c[0]}-D{c[1]}-C{c[2]}-{c[3]}-bias{c[4]}-block{c[5]}-{c[6]}-{c[7]}" for c in IN_PLACE])
def test_cublas_in_place_matches_reference(N, D, C, dt, bias, block, reduction, activation, device):
    klh._PLANS.clear()
    cfg = LaunchConfig(vocab_path="cublas_in_place", chunk_size=block)
    check("ce", N, D, C, DTYPES[dt], bias, None, device, reduction=reduction, config=cfg, activation=activation)
    assert {p.kind for p in klh._PLANS.values()} == {"cublas_in_place"}


def test_cublas_in_place_is_reproducible_and_refuses_what_it_cannot_hold(device):
    from erase_triton import LocalHead
    from erase_triton.functional import local_head_into

    cfg = LaunchConfig(vocab_path="cublas_in_place", chunk_size=128)
    h, w, b, y = make("ce", 48, 64, 900, torch.float32, True, device)
    one, two = (fused_local_head(h, w, b, y, loss="ce", backend="triton", config=cfg) for _ in range(2))
    for a, c in zip(one, two):
        assert torch.equal(a, c)
    h2, w2, b2, y2 = make("ce", 65, 64, 900, torch.float32, True, device)  # N > D: the logits do not fit
    with pytest.raises(ValueError, match=r"takes at most D = 64 rows, got N = 65; use vocab_path='cublas'"):
        fused_local_head(h2, w2, b2, y2, loss="ce", backend="triton", config=cfg)
    with pytest.raises(ValueError, match=r"cannot add to an existing gradient \(accumulate=True"):
        local_head_into(h, w, b, y, loss="ce", reduction="mean", ignore_index=-100, backend="triton", config=cfg,
                        grad_weight=torch.zeros_like(w), grad_bias=torch.zeros_like(b), accumulate=True)
    head = LocalHead(64, 900, loss="ce").to(device)
    head.configure(vocab_path="cublas_in_place")
    head(h.detach().requires_grad_(True), y)  # .grad None: the head's first gradient is written, not added
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()


# cublas_vocab_chunks' Gluon pass 1 on Hopper (kernels/vocab_ce_lse_gemm.py). Gluon does not run in the
# interpreter: its GEMM kernel is compiled for sm_90a here (and run by tests/test_gpu.py), its merge runs here.
@pytest.mark.parametrize("mean,init", [(True, False), (False, False), (True, True)])
def test_lse_merge_kernel_matches_torch(mean, init, device):
    # merge_kernel (vocab_ce_cublas.py, which the Gluon pass shares with cublas_in_place) on 70 rows (the last
    # block short at a 64-row block) and 19 splits of per-split base-2 (max, sum) and the targets' logits where
    # their split holds them; an ignored row, a bad id. init: the last split's pair and logit are instead the
    # running ones already in lse and rows_loss (what chunk_lse_kernel leaves of a first chunk)
    from erase_triton.kernels.vocab_ce_cublas import merge_kernel
    torch.manual_seed(0)
    N, C, S = 70, 1900, 19
    z = torch.randn(N, C, device=device) * 3
    y = torch.randint(0, C, (N,), device=device)
    y[5], y[9] = -100, C + 3  # ignored; out of range (NaN loss and factor)
    u = z.view(N, S, C // S) * 1.4426950408889634
    m = u.amax(2)
    s = torch.exp2(u - m[..., None]).sum(2)
    held = y.clamp(0, C - 1)[:, None] // (C // S) == torch.arange(S, device=device)[None, :]
    zt = torch.where(held & (y[:, None] >= 0) & (y[:, None] < C), z.gather(1, y.clamp(0, C - 1)[:, None]), 0.0)
    scale = torch.tensor([1 / 68.0], device=device)
    rows_loss, lse = torch.empty(N, device=device), torch.empty(2 * N, device=device)
    if init:
        lse[:N], lse[N:], rows_loss[:] = m[:, -1], s[:, -1], zt[:, -1]
        m, s, zt, S = m[:, :-1], s[:, :-1], zt[:, :-1], S - 1
    part = torch.cat([m.t().reshape(-1), s.t().reshape(-1), zt.t().reshape(-1)])
    merge_kernel[(triton.cdiv(N, 64),)](part, y, scale, rows_loss, lse, S, N, C, -100, MEAN=mean, INIT=init,
                                        BLOCK=64)
    zt = z.gather(1, y.clamp(0, C - 1)[:, None])[:, 0]
    ref = torch.logsumexp(z.double(), 1)
    ok = torch.ones(N, dtype=torch.bool, device=device)
    ok[[5, 9]] = False
    torch.testing.assert_close(lse[:N][ok].double(), ref[ok] * 1.4426950408889634, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(rows_loss[ok].double(), (ref - zt.double())[ok], rtol=1e-5, atol=1e-5)
    assert rows_loss[5] == 0 and lse[N + 5] == 0  # an ignored row: no loss, no gradient
    assert rows_loss[9].isnan() and lse[N + 9].isnan()
    factor = lse[N:][ok]
    assert torch.all(factor == (scale[0] if mean else 1.0))


@pytest.mark.parametrize("D,bias", [(512, True), (520, True), (512, False)])
def test_lse_gemm_kernel_compiles_for_hopper_without_spills(D, bias):
    # what its speed rests on (docs/tuning.md#vocabulary-ce-paths): wgmma, TMA loads, no spills, and a program
    # that fits an SM (227 KB of shared memory a block; its 12 warps' registers within 64K). D = 512: the row
    # tile's x resident in shared memory; D = 520: x streamed, a last K step past D (TMA's zero fill); without a
    # bias the epilogue's z is its own add, not the loop's accumulator (which, held across a branch, spilled)
    from test_local_head import _compile_report
    r = _compile_report("--D", str(D), "--lse-gemm", *([] if bias else ["--no-bias"]))
    assert r.returncode == 0 and "regs=" in r.stdout, r.stderr[-800:]
    got = dict(kv.split("=", 1) for kv in r.stdout.split())
    assert got["mma_versions"] == "3" and int(got["wgmma"]) > 0 and int(got["tma_loads"]) > 0
    assert got["resident"] == str(int(D == 512))
    assert int(got["spill_bytes"]) == 0
    assert int(got["shared"]) <= 227 * 1024 and int(got["threads"]) * int(got["regs"]) <= 65536


@pytest.mark.parametrize("bias", [True, False])
def test_pipelined_dz_compiles_to_async_copies_for_hopper(bias):
    # what DZ_STAGES changes on the device (the interpreter ignores num_stages): the default's dz loop issues
    # plain loads; at 3 stages its loads of z become cp.async copies into shared memory, without spills
    from test_local_head import _compile_report
    got = {}
    for st in (0, 3):
        r = _compile_report("--dz", "--C", "2816", *([] if bias else ["--no-bias"]), "--set", f"STAGES={st}")
        assert r.returncode == 0 and "regs=" in r.stdout, r.stderr[-800:]
        got[st] = dict(kv.split("=", 1) for kv in r.stdout.split())
        assert got[st]["STAGES"] == str(st) and int(got[st]["spill_bytes"]) == 0
    assert int(got[0]["async_copies"]) == 0 and int(got[3]["async_copies"]) > 0
    assert int(got[3]["shared"]) <= 227 * 1024


@pytest.mark.parametrize("classes", [None, 700])
def test_lse_gemm_hands_its_kernel_the_scratch_and_merges_it(classes, monkeypatch, device):
    # LseGemm's host side on the CPU, with a stand-in for the Gluon kernel that writes what the kernel would (each
    # consumer's max, sum and target's logit over its alternate tiles of a split) into the scratch it is handed:
    # the merge then leaves every row's lse, factor and loss in place. classes=700: the kernel gets classes
    # [0, 700), the rest's running pair and targets' logits are in lse and rows_loss before the call
    from erase_triton.kernels import vocab_ce_lse_gemm as lg
    from erase_triton.kernels.direct import KernelLaunch
    torch.manual_seed(0)
    N, D, C = 300, 64, 1000
    x = torch.randn(N, D, device=device).to(torch.bfloat16)
    w = torch.randn(C, D, device=device).to(torch.bfloat16)
    y = torch.randint(0, C, (N,), device=device)
    z = x.float() @ w.float().t()
    seen = {}

    class Kernel:  # lse_gemm_kernel[grid](x_desc, w_desc, b, y, part, N, C, tiles_per, **constexprs)
        def __getitem__(self, grid):
            def run(xd, wd, b, yy, part, n, c, tiles_per, **cx):
                seen.update(grid=grid, tiles_per=tiles_per, cx=cx, shapes=(xd.shape, wd.shape))
                S2, BN = 2 * grid[1], lg.TILE[1]
                u = z * 1.4426950408889634
                for split in range(grid[1]):
                    for cons in (0, 1):
                        cols = [k for t in range(split * tiles_per + cons, min((split + 1) * tiles_per, -(-c // BN)), 2)
                                for k in range(t * BN, min(t * BN + BN, c))]
                        m = u[:, cols].amax(1)
                        o = (2 * split + cons) * N
                        part[o:o + N] = m
                        part[S2 * N + o:S2 * N + o + N] = torch.exp2(u[:, cols] - m[:, None]).sum(1)
                        held = torch.isin(yy, torch.tensor(cols, device=yy.device))
                        part[2 * S2 * N + o:2 * S2 * N + o + N] = torch.where(held, z.gather(1, yy[:, None])[:, 0], 0.0)
            return run

    monkeypatch.setattr(lg, "lse_gemm_kernel", Kernel())
    launch = lambda kernel, grid, cx, args: KernelLaunch(kernel, grid, cx)  # noqa: E731
    with monkeypatch.context() as m:  # 3 SMs while the split is planned only (Triton's CUDA driver reads them too)
        m.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"multi_processor_count": 3}))
        lse_gemm = lg.LseGemm(N, C, D, True, -100, False, torch.device(device), launch, y, classes=classes)
    V = classes or C
    # 8 (6) vocabulary tiles x 3 row tiles over 3 SMs: 8 (6) tiles a split, one split (two consumers' pairs)
    assert (lse_gemm.tiles_per, lse_gemm.splits) == (-(-V // lg.TILE[1]), 2)
    scratch = torch.full((lse_gemm.n_part,), float("nan"), device=device)
    scale = torch.tensor([1 / N], device=device)
    rows_loss, lse = torch.empty(N, device=device), torch.empty(2 * N, device=device)
    if classes:  # the rest's base-2 max and sum, and the targets' logits where they are there
        u = z[:, V:] * 1.4426950408889634
        lse[:N] = u.amax(1)
        lse[N:] = torch.exp2(u - lse[:N, None]).sum(1)
        rows_loss[:] = torch.where(y >= V, z.gather(1, y[:, None])[:, 0], 0.0)
    lse_gemm(None, x, w, None, y, scratch, scale, rows_loss, lse)
    assert seen["grid"] == (3, 1) and seen["shapes"] == ([N, D], [V, D]) and seen["cx"]["KS"] == 1
    ref = torch.logsumexp(z.double(), 1)
    torch.testing.assert_close(lse[:N].double(), ref * 1.4426950408889634, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(rows_loss.double(), ref - z.gather(1, y[:, None])[:, 0].double(), rtol=1e-5,
                               atol=1e-5)
    assert torch.all(lse[N:] == 1 / N)
