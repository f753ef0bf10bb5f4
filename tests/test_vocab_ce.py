"""The vocabulary CE kernels (C > 512; kernels/vocab_ce.py and, with LaunchConfig(vocab_path="chunked"),
kernels/vocab_ce_chunked.py): long rows, out-of-range class ids, the chunks, against the float64 reference."""

import pytest
import torch

import erase_triton.kernels.plan as klh
from erase_triton import LaunchConfig, fused_local_head
from head_checks import DTYPES, check, make, poison  # noqa: F401  (poison: the autouse fixture)


def test_ce_vocab_large_rows(device):
    # several row tiles and vocabulary tiles, with ignored rows
    check("ce", 781, 130, 1000, torch.float32, False, 1.0, device)


# The small-vocabulary CE kernel (64 < C <= 512): odd and full class counts, every dtype,
# ignored rows, with and without bias, and row groups (split-K phase B + phase R) where N is
# long enough (1100 rows under the interpreter: 9 row blocks of 128, 2 groups at occupancy 1/2).
# 16-bit inputs with C <= 256 take the grad_h^T = W^T dz^T form (GH_T), the others dz W.
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy sees the NaN made
@pytest.mark.parametrize("C,kind", [(5, "dense"), (100, "small"), (1000, "vocab"), (1000, "vocab_chunked")])
def test_ce_class_id_out_of_range_poisons_with_nan(C, kind, device):
    # ids >= C and negative ids other than ignore_index: no out-of-bounds read (the vocabulary kernel
    # gathers W[t]), a NaN loss and NaN gradients where the row reaches, every other row as before
    h, w, b, y = make("ce", 40, 32, C, torch.float32, True, device)
    bad = torch.tensor([3, 7])
    y_bad = y.clone()
    y_bad[3], y_bad[7] = C, -1
    klh._PLANS.clear()
    cfg = LaunchConfig(vocab_path="chunked" if kind == "vocab_chunked" else None)
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


# The chunked vocabulary path (kernels/vocab_ce_chunked.py, LaunchConfig(vocab_path="chunked")):
# one chunk and several (the last one short: 1000 = 3 x 256 + 232), one row tile and several, every
# dtype, with and without bias, the ReLU, sum reduction, one program (occupancy 1/32: every stage
# barrier with a single program) and several vocabulary splits in stage L (occupancy 1, 4 programs).
CHUNKED = [  # N, D, C, dtype, bias, occupancy, chunk, activation, reduction
    (63, 50, 1000, "fp32", True, None, None, None, "mean"),
    (300, 130, 1000, "fp32", False, 0.5, 256, None, "mean"),
    (300, 40, 1000, "bf16", True, 1 / 32, 384, "relu", "mean"),
    (63, 50, 1000, "fp16", True, None, 128, None, "sum"),
    (1, 50, 1000, "bf16", False, None, 256, None, "mean"),
    (130, 33, 513, "fp32", True, 1 / 32, 256, "relu", "sum"),
]


@pytest.mark.parametrize("N,D,C,dt,bias,occupancy,chunk,activation,reduction", CHUNKED,
                         ids=[f"N{c[0]}-D{c[1]}-C{c[2]}-{c[3]}-chunk{c[6]}" for c in CHUNKED])
def test_chunked_vocab_matches_reference(N, D, C, dt, bias, occupancy, chunk, activation, reduction, device):
    klh._PLANS.clear()
    cfg = LaunchConfig(occupancy=occupancy, vocab_path="chunked", vocab_chunk=chunk)
    check("ce", N, D, C, DTYPES[dt], bias, None, device, reduction=reduction, config=cfg, activation=activation)
    assert {p.kind for p in klh._PLANS.values()} == {"vocab_chunked"}


def test_chunked_vocab_is_bitwise_reproducible_and_close_to_the_recompute_path(device):
    h, w, b, y = make("ce", 300, 40, 1000, torch.float32, True, device)
    chunked = LaunchConfig(vocab_path="chunked", vocab_chunk=256)
    a = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=chunked)
    again = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=chunked)
    other = fused_local_head(h, w, b, y, loss="ce", backend="triton", config=LaunchConfig(vocab_path="recompute"))
    for x, z, r in zip(a, again, other):
        assert torch.equal(x, z)
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-6)


def test_chunked_vocab_chunk_rule():
    cfg = LaunchConfig()
    # (4096, 512, 32000) bf16: a 16 MiB dz scratch, 2048 columns (16 chunks)
    assert klh.vocab_chunk(4096, 32000, 512, 2, 2, 128, cfg) == 2048
    # (4096, 4096, 128256) bf16: a quarter of grad_W's 1.05 GB, balanced over 5 chunks
    c = klh.vocab_chunk(4096, 128256, 4096, 2, 2, 128, cfg)
    assert c % 128 == 0 and -(-128256 // c) == 5 and 4096 * c * 2 <= 128256 * 4096 * 2 // 4 + 128 * 4096 * 2
    # small heads: one chunk of the whole (padded) vocabulary; an explicit chunk rounded up to the tile
    assert klh.vocab_chunk(63, 1000, 50, 4, 4, 128, cfg) == 1024
    assert klh.vocab_chunk(63, 1000, 50, 4, 4, 128, LaunchConfig(vocab_chunk=300)) == 384


@pytest.mark.parametrize("kw,match", [(dict(vocab_path="fast"), "vocab_path must be one of"),
                                      (dict(vocab_chunk=0), "vocab_chunk must be a positive int"),
                                      (dict(vocab_chunk=True), "vocab_chunk must be a positive int"),
                                      (dict(vocab_chunk=2.5), "vocab_chunk must be a positive int")])
def test_vocab_options_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        LaunchConfig(**kw)
