"""fused_local_head against the float64 reference (tests/head_checks.py: the rule), across the three
kernels: a covering design of shapes, dtypes and occupancies, reductions, the ReLU taken over from the
block, layouts, accumulation, determinism, dtype mixes, argument checks, and a planted 2% error that
must fail the check. Kernel-specific tests: test_dense_head.py, test_small_ce.py, test_vocab_ce.py.
Kernels run under TRITON_INTERPRET=1 on CPU (conftest.py)."""
import itertools
import os

import pytest
import torch

import erase_triton.functional as functional
import erase_triton.kernels.plan as klh
from erase_triton import LaunchConfig, fused_local_head, reference
from erase_triton.functional import local_head_into
from head_checks import ATOL, DTYPES, assert_three_way, check, make, poison  # noqa: F401  (poison: autouse)



# A covering design over loss x dtype x N x D x C x bias x occupancy: every value of
# every axis meets every loss and dtype, without the full 1296-case product.
SHAPES = {
    "bce": [(1, 1, 1), (63, 50, 3), (781, 130, 17), (63, 130, 1), (781, 1, 3)],
    "mse": [(1, 50, 17), (63, 1, 1), (781, 130, 3), (63, 130, 17), (781, 50, 1)],
    "ce": [(1, 130, 3), (63, 50, 17), (781, 1, 3), (63, 130, 1000), (1, 50, 1000)],
}
CASES = []
for loss, (dn, dt) in itertools.product(SHAPES, DTYPES.items()):
    for i, (N, D, C) in enumerate(SHAPES[loss]):
        det = (i // 2) % 2 == 0  # the fixed-order reduction, or float atomics where they apply
        CASES.append(pytest.param(loss, N, D, C, dt, i % 2 == 0, (None, 1 / 32)[i % 2], det,
                                  id=f"{loss}-{dn}-N{N}-D{D}-C{C}-{'b' if i % 2 == 0 else 'nob'}-occ{(1, 32)[i % 2]}"
                                     f"-{'det' if det else 'atomic'}"))


@pytest.mark.parametrize("loss,N,D,C,dtype,bias,occupancy,det", CASES)
def test_matches_reference(loss, N, D, C, dtype, bias, occupancy, det, device):
    check(loss, N, D, C, dtype, bias, None, device, config=LaunchConfig(occupancy=occupancy, deterministic=det or None))


@pytest.mark.parametrize("loss", ["bce", "ce", "mse"])
def test_sum_reduction(loss, device):
    check(loss, 63, 50, 17, torch.float32, True, None, device, reduction="sum")


# activation="relu" in every kernel: the dense kernel with one weight tile (atomic and
# fixed-order) and with D chunks, the dense CE path, the small and the vocabulary CE kernels.
RELU = [("bce", 781, 130, 1, "fp32", True, None, False), ("bce", 63, 130, 1, "bf16", False, 1 / 32, True),
        ("mse", 63, 50, 17, "fp16", True, 0.5, True), ("ce", 63, 50, 17, "fp32", True, None, True),
        ("ce", 300, 40, 130, "bf16", True, 0.5, True), ("ce", 300, 40, 130, "fp32", False, None, True),
        ("ce", 63, 50, 1000, "fp32", True, None, True), ("ce", 63, 50, 1000, "bf16", False, 1 / 32, True)]


@pytest.mark.parametrize("loss,N,D,C,dt,bias,occupancy,det", RELU,
                         ids=[f"{c[0]}-N{c[1]}-D{c[2]}-C{c[3]}-{c[4]}" for c in RELU])
def test_relu_activation_matches_reference(loss, N, D, C, dt, bias, occupancy, det, device):
    klh._PLANS.clear()
    check(loss, N, D, C, DTYPES[dt], bias, None, device,
          config=LaunchConfig(occupancy=occupancy, deterministic=det), activation="relu")
    kinds = {p.kind for p in klh._PLANS.values()}
    vocab = klh.vocab_path_for(LaunchConfig(occupancy=occupancy, deterministic=det), D,
                               (DTYPES[dt], DTYPES[dt], DTYPES[dt] if bias else None), device.type == "cuda")
    assert kinds == {"dense" if loss != "ce" or C <= 64 else "small" if C <= 512 else vocab}


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_relu_activation_recompute_path(dt, device):
    # the default vocabulary path is a chunked one (above); the recompute kernel takes the ReLU too
    klh._PLANS.clear()
    check("ce", 63, 50, 1000, DTYPES[dt], dt == "fp32", None, device, config=LaunchConfig(vocab_path="recompute"),
          activation="relu")
    assert {p.kind for p in klh._PLANS.values()} == {"vocab"}


def test_default_vocab_path_follows_the_width():
    assert [klh.default_vocab_path(D) for D in (64, 512, 2047, 2048, 4096)] == \
        ["vocab_chunks"] * 3 + ["row_chunks"] * 2


def test_vocab_path_rule_takes_cublas_for_bf16_at_full_occupancy(monkeypatch):
    bf, f32, f16 = torch.bfloat16, torch.float32, torch.float16
    rule = klh.vocab_path_for
    base = LaunchConfig()
    assert rule(base, 512, (bf, bf, bf), True) == rule(base, 4096, (bf, bf, None), True) == "cublas"
    assert rule(LaunchConfig(occupancy=1.0), 512, (bf, bf, bf), True) == "cublas"
    assert rule(LaunchConfig(deterministic=True, chunk_size=2048), 512, (bf, bf, bf), True) == "cublas"
    # in place where it can be: at most D rows, no .grad to add to, no chunk size (rows, for "cublas")
    assert rule(base, 512, (bf, bf, bf), True, N=512, accumulate=False) == "cublas_in_place"
    assert rule(base, 512, (bf, bf, None), True, N=1, accumulate=False) == "cublas_in_place"
    assert rule(base, 512, (bf, bf, bf), True, N=513, accumulate=False) == "cublas"
    assert rule(base, 512, (bf, bf, bf), True, N=512, accumulate=True) == "cublas"
    assert rule(LaunchConfig(chunk_size=256), 512, (bf, bf, bf), True, N=512, accumulate=False) == "cublas"
    assert rule(base, 512, (bf, bf, bf), False, N=512, accumulate=False) == "vocab_chunks"
    assert rule(LaunchConfig(vocab_path="cublas"), 512, (bf, bf, bf), True, N=8, accumulate=False) == "cublas"
    # otherwise the width rule's Triton path: on the CPU; other dtypes (autocast's fp32 weights, an
    # fp32 bias, fp16, fp32); a partial occupancy; a Triton-only tuning field
    for cfg, dtypes, cuda in ((base, (bf, bf, bf), False), (base, (bf, f32, f32), True), (base, (bf, bf, f32), True),
                              (base, (f16, f16, None), True), (base, (f32, f32, f32), True),
                              (LaunchConfig(occupancy=0.125), (bf, bf, bf), True),
                              (LaunchConfig(block_n=64), (bf, bf, bf), True),
                              (LaunchConfig(num_warps=4), (bf, bf, bf), True)):
        assert rule(cfg, 512, dtypes, cuda) == "vocab_chunks", (cfg, dtypes, cuda)
    assert rule(base, 4096, (f32, f32, f32), True) == "row_chunks"
    assert rule(LaunchConfig(vocab_path="recompute"), 512, (bf, bf, bf), True) == "recompute"  # a named path is kept
    # torch's deterministic mode refuses cuBLAS without CUBLAS_WORKSPACE_CONFIG: the Triton path then
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(True)
    try:
        assert rule(base, 512, (bf, bf, bf), True) == "vocab_chunks"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        assert rule(base, 512, (bf, bf, bf), True) == "cublas"
    finally:
        torch.use_deterministic_algorithms(False)


def test_launch_takes_the_rules_vocab_path(monkeypatch, device):
    # vocab_path=None: prepare_launch runs what vocab_path_for names (here forced to "cublas", which runs anywhere)
    monkeypatch.setattr(klh, "vocab_path_for", lambda *a: "cublas")
    klh._PLANS.clear()
    check("ce", 70, 40, 1000, torch.float32, True, None, device)
    assert {p.kind for p in klh._PLANS.values()} == {"cublas"}


@pytest.mark.parametrize("loss,N,D,C,dt,bias,occupancy,det", RELU + [("mse", 63, 130, 17, "fp32", True, None, True)],
                         ids=[f"{c[0]}-N{c[1]}-D{c[2]}-C{c[3]}-{c[4]}" for c in RELU] + ["mse-chunked"])
def test_relu_act_out(loss, N, D, C, dt, bias, occupancy, det, device):
    # act_out: the dense and small CE kernels write relu(h) as they read h (STORE_ACT), the
    # vocabulary kernel leaves it to torch.clamp_min; either way act_out == relu(h) exactly, and the
    # loss and gradients are those of the same launch without it
    h, w, b, y = make(loss, N, D, C, DTYPES[dt], bias, device)
    cfg = LaunchConfig(occupancy=occupancy, deterministic=det, block_d=32 if D == 130 and C == 17 else None)
    outs = []
    for act in (None, torch.full_like(h, float("nan"))):
        klh._PLANS.clear()
        gw, gb = torch.empty_like(w), torch.empty_like(b) if bias else None
        loss_t, gh = local_head_into(h, w, b, y, loss=loss, reduction="mean", ignore_index=-100, backend="triton",
                                     config=cfg, grad_weight=gw, grad_bias=gb, accumulate=False, activation="relu",
                                     act_out=act)
        outs.append((loss_t, gh, gw, gb))
    kind = {p.kind for p in klh._PLANS.values()}.pop()
    assert {p.constexprs.get("STORE_ACT", False) for p in klh._PLANS.values()} == {kind in ("dense", "small")}
    assert torch.equal(act, torch.relu(h)), "act_out != relu(h)"
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0)  # grad_h: per row, no reduction
    exact = det or device.type == "cpu"  # float atomics on the GPU: the sums' last bits follow timing
    for a, c in zip(outs[0], outs[1]):
        if a is not None:
            torch.testing.assert_close(c, a, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)


def test_act_out_checks(device):
    h, w, b, y = make("bce", 8, 16, 1, torch.float32, True, device)
    kw = dict(loss="bce", reduction="mean", ignore_index=-100, backend="triton", config=LaunchConfig(),
              grad_weight=torch.empty_like(w), grad_bias=torch.empty_like(b), accumulate=False)
    with pytest.raises(ValueError, match="act_out needs activation='relu'"):
        local_head_into(h, w, b, y, act_out=torch.empty_like(h), **kw)
    with pytest.raises(ValueError, match="act_out must be a contiguous torch.float32 tensor of shape"):
        local_head_into(h, w, b, y, activation="relu", act_out=torch.empty_like(h, dtype=torch.bfloat16), **kw)
    with pytest.raises(ValueError, match="act_out must be a contiguous"):
        local_head_into(h, w, b, y, activation="relu", act_out=torch.empty(16, 8, device=device).t(), **kw)


@pytest.mark.parametrize("loss,C", [("bce", 3), ("ce", 1000)])
def test_small_tiles_many_chunks(loss, C, device):
    # forces several D chunks and many row groups: exercises the partial-sum paths
    cfg = LaunchConfig(block_n=16, block_d=32)
    check(loss, 100, 130, C, torch.float32, True, None, device, config=cfg)


def test_leading_dims_and_scalar_bce_target(device):
    h, w, b, _ = make("bce", 12, 40, 1, torch.float32, True, device)
    h3 = h.reshape(3, 4, 40)
    y = torch.rand(3, 4, device=device).round()
    out = fused_local_head(h3, w, b, y, backend="triton")
    ref = reference.local_head(h3.double(), w.double(), b.double(), y.double())
    assert out.grad_h.shape == (3, 4, 40)
    torch.testing.assert_close(out.grad_h.double(), ref.grad_h, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(out.loss.double(), ref.loss, rtol=1e-5, atol=1e-7)


def test_non_contiguous_h(device):
    h, w, b, y = make("mse", 63, 50, 3, torch.float32, True, device)
    hw = torch.randn(63, 80, device=device)
    hw[:, :50] = h
    hv = hw[:, :50]  # row stride 80, unit stride on D
    out = fused_local_head(hv, w, b, y, loss="mse", backend="triton")
    ref = reference.local_head(h, w, b, y, loss="mse")
    torch.testing.assert_close(out.grad_h, ref.grad_h, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.grad_weight, ref.grad_weight, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("C,path", [(17, None), (1000, "recompute"), (1000, "vocab_chunks"), (1000, "row_chunks"),
                                    (1000, "cublas"), (1000, "cublas_vocab_chunks")])
def test_accumulates_into_given_grads(C, path, device):
    # (the chunked paths: two chunks, so grad_W is also summed over chunks on top of what it held)
    h, w, b, y = make("ce", 63 if path is None else 200, 50, C, torch.float32, True, device)
    gw0, gb0 = torch.randn_like(w), torch.randn_like(b)
    gw, gb = gw0.clone(), gb0.clone()
    local_head_into(h, w, b, y, loss="ce", reduction="mean", ignore_index=-100, backend="triton",
                    config=LaunchConfig(vocab_path=path, chunk_size={"vocab_chunks": 512, "row_chunks": 128, "cublas": 128, "cublas_vocab_chunks": 512}.get(path)), grad_weight=gw, grad_bias=gb, accumulate=True)
    ref = reference.local_head(h, w, b, y, loss="ce")
    torch.testing.assert_close(gw, gw0 + ref.grad_weight, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gb, gb0 + ref.grad_bias, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("C,path", [(5, None), (1000, "recompute"), (1000, "vocab_chunks"), (1000, "row_chunks"),
                                    (1000, "cublas"), (1000, "cublas_vocab_chunks")])
def test_all_rows_ignored_gives_nan_loss_and_zero_grads(C, path, device):
    h, w, b, y = make("ce", 20, 16, C, torch.float32, True, device)
    y.fill_(-100)
    out = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=LaunchConfig(vocab_path=path))
    assert torch.isnan(out.loss)  # as torch: mean over no rows
    assert (out.grad_h == 0).all() and (out.grad_weight == 0).all()


MIXED = [("bce", 1, "bf16", "fp32"), ("bce", 3, "bf16", "fp32"), ("mse", 2, "fp16", "fp32"), ("ce", 5, "bf16", "fp32"),
         ("ce", 100, "bf16", "fp32"), ("ce", 1000, "bf16", "fp32"), ("ce", 100, "fp32", "bf16")]


@pytest.mark.parametrize("loss,C,hdt,wdt", MIXED, ids=[f"mixed-{m[0]}-C{m[1]}-{m[2]}-{m[3]}" for m in MIXED])
def test_mixed_dtypes_take_the_weight_in_h_dtype(loss, C, hdt, wdt, device):
    # autocast training: bf16 activations, fp32 parameters. Every kernel takes the weight tile in h's
    # dtype for its tensor-core products (tl.dot needs one dtype on the GPU; _dot asserts it, so the
    # interpreter's fp32 upcast cannot hide a mix), and the grads come back in the parameters' dtypes.
    h, w, b, y = make(loss, 300, 48, C, torch.float32, True, device)
    h, w, b = h.to(DTYPES[hdt]), w.to(DTYPES[wdt]), b.to(DTYPES[wdt])
    out = fused_local_head(h, w, b, y, loss=loss, backend="triton")
    same = reference.local_head(h, w, b, y, loss=loss)
    ref = reference.local_head(h.double(), w.double(), b.double(), y if loss == "ce" else y.double(), loss=loss)
    assert out.grad_weight.dtype == w.dtype and out.grad_bias.dtype == b.dtype and out.grad_h.dtype == h.dtype
    coarse = max(DTYPES[hdt], DTYPES[wdt], key=ATOL.get)  # the tolerance of the less precise dtype
    for name in ("loss", "grad_h", "grad_weight", "grad_bias"):
        assert_three_way(getattr(out, name), getattr(same, name), getattr(ref, name), coarse, name)


def _compile_report(*args):
    # benchmarks/compile_report.py in a subprocess: it compiles for the device (sm_90a), not the interpreter,
    # and needs no GPU (ptxas ships with triton)
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, os.path.join(root, "benchmarks", "compile_report.py"), *args],
                          capture_output=True, text=True, env=env)


@pytest.mark.parametrize("loss,C,path", [("bce", 3, None), ("ce", 100, None), ("ce", 1000, None),
                                         ("ce", 1000, "vocab_chunks"), ("ce", 1000, "row_chunks")])
def test_mixed_dtypes_compile_for_the_gpu(loss, C, path):
    # what the interpreter cannot show: Triton's frontend for sm_90a (tl.dot needs one dtype there) accepts
    # every kernel with bf16 h and fp32 weights
    r = _compile_report("--loss", loss, "--C", str(C), "--D", "64", "--dtype", "bf16", "--wdtype", "fp32",
                        *(["--vocab-path", path] if path else []))
    assert r.returncode == 0 and "regs=" in r.stdout, r.stderr[-800:]


def _unordered_handoffs(ptx: str) -> list[str]:
    # the grid barrier's two halves in a kernel's PTX: every spin read of a done-counter (ld.volatile) is
    # followed by a fence.acq_rel.gpu before the next bar.sync (the waiting thread's acquire), and every
    # release of a counter comes after a bar.sync with such a fence before it (each thread's stores released)
    ins = [ln.strip() for ln in ptx.splitlines()]
    ins = [ln for ln in ins if ln and not ln.startswith(("//", ".loc", "$L", "{", "}", "mov.u32 %r"))]
    bad = []
    for i, ln in enumerate(ins):
        if "ld.volatile.global" in ln:
            j = next(k for k in range(i, len(ins)) if "bar.sync" in ins[k])
            if not any("fence.acq_rel.gpu" in x for x in ins[i:j]):
                bad.append(f"spin read at {i} has no fence before its bar.sync at {j}")
        if "atom.global.gpu.release" in ln:
            j = max(k for k in range(i) if "bar.sync" in ins[k])
            if not any("fence.acq_rel.gpu" in x for x in ins[max(0, j - 8):j]):
                bad.append(f"release at {i} has no fence before its bar.sync at {j}")
    return bad


@pytest.mark.parametrize("args", [["--loss", "bce", "--C", "1", "--D", "256", "--dtype", "fp32", "--deterministic"],
                                  ["--loss", "ce", "--C", "256"], ["--vocab-path", "recompute"],
                                  ["--vocab-path", "vocab_chunks"], ["--vocab-path", "row_chunks"]],
                         ids=["dense", "small_ce", "recompute", "vocab_chunks", "row_chunks"])
def test_grid_barrier_acquires_in_every_thread(args, tmp_path):
    # the ordering the kernels rely on, in the PTX Triton emits for sm_90a (no GPU needed). Triton 3.6
    # drops an atomic_add(p, 0, sem="acquire") whose result is unused, so nothing but these fences orders
    # a waiting program's reads after the other programs' writes (docs/local_head.md#memory-ordering).
    ptx = tmp_path / "k.ptx"
    defaults = ["--C", "1000", "--D", "64"] if "--vocab-path" in args else []
    r = _compile_report(*defaults, *args, "--ptx", str(ptx))
    assert r.returncode == 0, r.stderr[-800:]
    text = ptx.read_text()
    assert "ld.volatile.global" in text and "atom.global.gpu.release" in text  # the kernel has a grid barrier
    assert _unordered_handoffs(text) == []
    # the check itself: the same PTX without its fences fails it
    assert _unordered_handoffs(text.replace("fence.acq_rel.gpu;", ""))


def test_deterministic(device):
    h, w, b, y = make("ce", 781, 50, 17, torch.float32, True, device)
    cfg = LaunchConfig(deterministic=True)
    a = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=cfg)
    c = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=cfg)
    for x, z in zip(a, c):
        assert torch.equal(x, z)


def test_deterministic_default_follows_torch(device):
    # deterministic=None takes float atomics unless torch.use_deterministic_algorithms(True)
    h, w, b, y = make("bce", 63, 50, 1, torch.float32, True, device)
    klh._PLANS.clear()
    fused_local_head(h, w, b, y, backend="triton")
    plans = {k[-1]: p.constexprs["ATOMIC"] for k, p in klh._PLANS.items() if k[2:4] == (1, 50)}
    assert plans == {False: True}
    torch.use_deterministic_algorithms(True)
    try:
        out = fused_local_head(h, w, b, y, backend="triton")
    finally:
        torch.use_deterministic_algorithms(False)
    plans = {k[-1]: p.constexprs["ATOMIC"] for k, p in klh._PLANS.items() if k[2:4] == (1, 50)}
    assert plans == {False: True, True: False}
    ref = reference.local_head(h, w, b, y)
    torch.testing.assert_close(out.grad_weight, ref.grad_weight, rtol=1e-4, atol=1e-6)


def test_backend_auto_and_torch_agree(device):
    h, w, b, y = make("bce", 63, 50, 3, torch.float32, True, device)
    a = fused_local_head(h, w, b, y, backend="auto")
    t = fused_local_head(h, w, b, y, backend="torch")
    for x, z in zip(a, t):
        torch.testing.assert_close(x, z, rtol=1e-4, atol=1e-6)


def test_float64_goes_to_reference(device):
    h, w, b, y = make("bce", 8, 4, 1, torch.float64, True, device)
    out = fused_local_head(h, w, b, y)  # auto: the kernel has no fp64 path
    assert out.grad_h.dtype == torch.float64 and out.loss.dtype == torch.float64


# ------------------------------------------------------------------- bad input
# ------------------------------------------------------------------- bad input
def _good(device):
    return make("bce", 8, 4, 2, torch.float32, True, device)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: {**a, "h": a["h"].long()}, "h must be a floating"),
    (lambda a: {**a, "h": a["h"][:, :3]}, r"h must be \[\.\.\., 4\]"),
    (lambda a: {**a, "weight": a["weight"][0]}, r"weight must be a floating tensor \[C, D\]"),
    (lambda a: {**a, "bias": a["bias"][:1]}, r"bias must be a floating tensor \[2\]"),
    (lambda a: {**a, "target": a["target"][:, :1]}, r"target must have shape \(8, 2\)"),
    (lambda a: {**a, "target": a["target"].long()}, "target must be a floating tensor"),
    (lambda a: {**a, "loss": "ce"}, "target must be int64 or int32"),
    (lambda a: {**a, "loss": "ce", "target": torch.zeros(7, dtype=torch.long)}, r"target must have shape \(8,\)"),
    (lambda a: {**a, "loss": "hinge"}, "loss must be one of"),
    (lambda a: {**a, "reduction": "none"}, "reduction must be one of"),
    (lambda a: {**a, "backend": "cuda"}, "backend must be one of"),
    (lambda a: {**a, "activation": "gelu"}, "activation must be one of"),
    (lambda a: {**a, "weight": torch.zeros(65, 4), "bias": None, "target": torch.zeros(8, 65)},
     r"supports 1 <= C <= 64"),
    (lambda a: {**a, "weight": a["weight"].double()}, "weight must be float32, bfloat16 or float16"),
    (lambda a: {**a, "weight": torch.zeros(1, 4), "bias": None, "loss": "ce", "target": torch.zeros(8, dtype=torch.long)},
     "2 <= C"),
], ids=["h-int", "h-D", "w-1d", "bias-shape", "tgt-shape", "tgt-int", "ce-float-tgt", "ce-tgt-shape",
        "loss", "reduction", "backend", "activation", "bce-C", "w-fp64", "ce-C1"])
def test_bad_input(mutate, match, device):
    h, w, b, y = _good(device)
    a = mutate(dict(h=h, weight=w, bias=b, target=y, loss="bce", reduction="mean", backend="triton", activation=None))
    with pytest.raises(ValueError, match=match):
        fused_local_head(a["h"], a["weight"], a["bias"], a["target"], loss=a["loss"],
                         reduction=a["reduction"], backend=a["backend"], activation=a["activation"])


def test_batch_size_changes_do_not_replan(device):
    # N is do_not_specialize in the kernels and absent from the plan key: one plan (one
    # compiled kernel) serves every batch size of a head
    h, w, b, y = make("bce", 781, 50, 3, torch.float32, True, device)
    fused_local_head(h, w, b, y, backend="triton")
    n = len(klh._PLANS)
    for N in (1, 63, 500):
        fused_local_head(h[:N], w, b, y[:N], backend="triton")
    assert len(klh._PLANS) == n


def test_device_mismatch_names_argument():
    h, w, b, y = make("bce", 8, 4, 2, torch.float32, True, "cpu")
    with pytest.raises(ValueError, match="weight is on meta but h is on cpu"):
        fused_local_head(h, w.to("meta"), b, y)
    with pytest.raises(ValueError, match="target is on meta"):
        fused_local_head(h, w, b, y.to("meta"))


def test_bad_occupancy():
    with pytest.raises(ValueError, match="occupancy must be a number in"):
        LaunchConfig(occupancy=0.0)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        LaunchConfig(block_n=24)
    with pytest.raises(ValueError, match="group_tiles must be a positive int"):
        LaunchConfig(group_tiles=0)
    with pytest.raises(ValueError, match="deterministic must be a bool or None"):
        LaunchConfig(deterministic="no")
    for bad in (16, 256, 96.0):
        with pytest.raises(ValueError, match=r"max_registers must be an int in \[24, 255\]"):
            LaunchConfig(max_registers=bad)


def test_max_registers_is_a_cuda_compile_option():
    # ptxas' cap goes into every CUDA launch's compile options; the interpreter has no such option
    from erase_triton.kernels.plan import plan_for as _plan
    cfg = LaunchConfig(max_registers=96)
    args = ("bce", "mean", 1, 512, torch.bfloat16, True, False, cfg)
    assert _plan(*args, True, False, "ieee", False).opts == dict(num_warps=2, maxnreg=96)
    assert _plan(*args, False, True, "ieee", False).opts == dict(num_warps=2)
    assert _plan("bce", "mean", 1, 512, torch.bfloat16, True, False, LaunchConfig(), True, False, "ieee",
                 False).opts == dict(num_warps=2)
    # the rule's own cap: 8 x 512 fp32 row tiles beside another stream (occupancy < 1), not on the whole device,
    # not in bf16
    assert _plan("bce", "mean", 1, 512, torch.float32, True, False, LaunchConfig(0.125), True, False, "tf32",
                 False).opts == dict(num_warps=2, maxnreg=128)
    assert _plan("bce", "mean", 1, 1024, torch.float32, True, False, LaunchConfig(0.125), True, False, "tf32",
                 False).opts == dict(num_warps=2)
    assert _plan("bce", "mean", 1, 512, torch.bfloat16, True, False, LaunchConfig(0.125), True, False, "ieee",
                 False).opts == dict(num_warps=2)


def test_num_stages_is_a_cuda_compile_option_of_the_vocabulary_kernels():
    # the vocabulary kernels pipeline their K loops by Triton's num_stages; the dense kernel takes it as NUM_STAGES
    from erase_triton.kernels.plan import plan_for as _plan
    for path in ("recompute", "vocab_chunks", "row_chunks"):
        cfg = LaunchConfig(vocab_path=path, num_stages=4)
        assert _plan("ce", "mean", 32000, 512, torch.bfloat16, True, False, cfg, True, False, "ieee",
                     False).opts == dict(num_warps=8, num_stages=4)
        assert _plan("ce", "mean", 32000, 512, torch.bfloat16, True, False, cfg, False, False, "ieee",
                     False).opts == dict(num_warps=8)
    dense = _plan("bce", "mean", 1, 512, torch.bfloat16, True, False, LaunchConfig(num_stages=3), True, False, "ieee", False)
    assert "num_stages" not in dense.opts and dense.constexprs["NUM_STAGES"] == 3


def test_wrong_type():
    with pytest.raises(TypeError, match="h must be a torch.Tensor"):
        fused_local_head([1.0], torch.zeros(1, 1), None, torch.zeros(1))


def test_programs_per_sm_caps_the_grid(monkeypatch):
    # the grid rule on a pretend 132-SM device where the kernel fits 5 programs an SM
    import erase_triton.kernels.launch as launch
    monkeypatch.setattr(launch, "device_limits", lambda index: (132, 65536, 228 * 1024))
    monkeypatch.setitem(launch._PER_SM, ("k", "key", 0), 5)
    dev = torch.device("cuda", 0)
    P = lambda occ, pps: launch.num_programs("k", "key", None, dev, 2, occ, pps)  # noqa: E731
    assert (P(0.125, None), P(0.5, 1), P(1.0, 2), P(None, 8)) == (16 * 5, 66, 264, 660)
    with pytest.raises(ValueError, match="programs_per_sm must be a positive int"):
        LaunchConfig(programs_per_sm=0)


PLANTED = [(loss, dt, *SHAPES[loss][k]) for loss in SHAPES for dt in DTYPES for k in (1, 2)]


@pytest.mark.parametrize("output", ["loss", "grad_h", "grad_weight", "grad_bias"])
@pytest.mark.parametrize("loss,dname,N,D,C", PLANTED, ids=[f"{c[0]}-{c[1]}-N{c[2]}-D{c[3]}-C{c[4]}" for c in PLANTED])
def test_a_planted_2pct_error_fails_the_check(loss, dname, N, D, C, output, monkeypatch, device):
    # the tolerance rule catches a 2% systematic error in any kernel output: scale one output of every
    # launch by 1.02 and `check` (the test of every shape above) must fail
    check(loss, N, D, C, DTYPES[dname], True, None, device)  # passes as it is
    real = functional.local_head_into

    def planted(*a, **kw):
        loss_t, grad_h = real(*a, **kw)
        if output in ("grad_weight", "grad_bias"):
            kw[output].mul_(1.02)
        return (loss_t * 1.02, grad_h) if output == "loss" else (loss_t, grad_h * 1.02 if output == "grad_h" else grad_h)
    monkeypatch.setattr(functional, "local_head_into", planted)
    with pytest.raises(AssertionError, match=f"^{output}: "):
        check(loss, N, D, C, DTYPES[dname], True, None, device)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's rounding (conftest.py)")
def test_the_interpreter_rounds_fp32_to_bf16_to_nearest_even():
    # as cvt.rn.bf16.f32 on the GPU; truncating, every bf16 output the tests compare carried a -0.3% bias
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < N).to(tl.bfloat16), mask=o < N)

    x = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(0)),
                   torch.tensor([1.99999, -1.99999, 3.0e38, float("inf"), float("-inf"), 1e-40, -0.0, 0.0])])
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    cast[(1,)](x, y, x.numel(), BLOCK=4096)
    assert torch.equal(y.view(torch.int16), x.bfloat16().view(torch.int16))


def test_kernels_round_bf16_to_nearest_even(device):
    # the GPU's cvt.rn (and, via conftest's round_bf16_like_the_gpu, the interpreter's): 1 + 0.75 ulp rounds up,
    # 1 + 0.5 ulp to the even 1, a tie above an odd mantissa up; truncation would give 1 and 1 + ulp below
    import triton
    import triton.language as tl

    @triton.jit
    def to_bf16(x_ptr, out_ptr, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(out_ptr + o, tl.load(x_ptr + o).to(tl.bfloat16))

    ulp = 2.0 ** -7
    x = torch.tensor([1 + 0.75 * ulp, 1 + 0.5 * ulp, 1 + 1.5 * ulp, -(1 + 0.75 * ulp)], device=device)
    out = torch.empty(4, dtype=torch.bfloat16, device=device)
    to_bf16[(1,)](x, out, BLOCK=4)
    assert out.tolist() == x.to(torch.bfloat16).tolist() == [1 + ulp, 1.0, 1 + 2 * ulp, -(1 + ulp)]
