"""The vocabulary CE kernel (kernels/vocab_ce.py: C > 512): long rows and out-of-range class ids,
against the float64 reference."""

import pytest
import torch

import erase_triton.kernels.plan as klh
from erase_triton import fused_local_head
from head_checks import DTYPES, check, make, poison  # noqa: F401  (poison: the autouse fixture)


def test_ce_vocab_large_rows(device):
    # several row tiles and vocabulary tiles, with ignored rows
    check("ce", 781, 130, 1000, torch.float32, False, 1.0, device)


# The small-vocabulary CE kernel (64 < C <= 512): odd and full class counts, every dtype,
# ignored rows, with and without bias, and row groups (split-K phase B + phase R) where N is
# long enough (1100 rows under the interpreter: 9 row blocks of 128, 2 groups at occupancy 1/2).
# 16-bit inputs with C <= 256 take the grad_h^T = W^T dz^T form (GH_T), the others dz W.
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy sees the NaN made
@pytest.mark.parametrize("C,kind", [(5, "dense"), (100, "small"), (1000, "vocab")])
def test_ce_class_id_out_of_range_poisons_with_nan(C, kind, device):
    # ids >= C and negative ids other than ignore_index: no out-of-bounds read (the vocabulary kernel
    # gathers W[t]), a NaN loss and NaN gradients where the row reaches, every other row as before
    h, w, b, y = make("ce", 40, 32, C, torch.float32, True, device)
    bad = torch.tensor([3, 7])
    y_bad = y.clone()
    y_bad[3], y_bad[7] = C, -1
    klh._PLANS.clear()
    out = fused_local_head(h, w, b, y_bad, loss="ce", backend="triton")
    assert {p.kind for p in klh._PLANS.values()} == {kind}
    assert torch.isnan(out.loss)
    assert torch.isnan(out.grad_h[bad]).all() and torch.isnan(out.grad_weight).any() and torch.isnan(out.grad_bias).any()
    good = torch.ones(40, dtype=torch.bool)
    good[bad] = False
    y_ok = y_bad.clone()
    y_ok[bad] = 0  # in range: the same rows count toward the mean
    ok = fused_local_head(h, w, b, y_ok, loss="ce", backend="triton")
    torch.testing.assert_close(out.grad_h[good.to(h.device)], ok.grad_h[good.to(h.device)])
    with pytest.raises(IndexError):  # the PyTorch backend stops, as F.cross_entropy does
        fused_local_head(h.cpu(), w.cpu(), b.cpu(), y_bad.cpu(), loss="ce", backend="torch")
