"""The small-vocabulary CE kernel (kernels/small_ce.py: 64 < C <= 512): row groups, accumulation,
determinism, a launch stopped part-way, against the float64 reference."""
import os

import pytest
import torch

import erase_triton.functional as functional
import erase_triton.kernels.plan as klh
from erase_triton import LaunchConfig, fused_local_head, reference
from erase_triton.functional import local_head_into
from head_checks import DTYPES, check, make, poison  # noqa: F401  (poison: the autouse fixture)


# The small-vocabulary CE kernel (64 < C <= 512): odd and full class counts, every dtype,
# ignored rows, with and without bias, and row groups (split-K phase B + phase R) where N is
# long enough (1100 rows under the interpreter: 9 row blocks of 128, 2 groups at occupancy 1/2).
# 16-bit inputs with C <= 256 take the grad_h^T = W^T dz^T form (GH_T), the others dz W.
SMALL_CE = [(63, 50, 65, "fp32", True, None, "mean"), (781, 130, 130, "bf16", False, 1 / 32, "mean"),
            (1100, 64, 256, "fp16", True, 0.5, "mean"), (1100, 48, 200, "fp32", False, 0.5, "sum"),
            (1, 130, 100, "bf16", True, None, "sum"), (300, 40, 300, "fp32", True, None, "mean"),
            (129, 24, 512, "bf16", False, 0.5, "mean")]


@pytest.mark.parametrize("N,D,C,dt,bias,occupancy,reduction", SMALL_CE,
                         ids=[f"N{c[0]}-D{c[1]}-C{c[2]}-{c[3]}" for c in SMALL_CE])
def test_small_ce_kernel_matches_reference(N, D, C, dt, bias, occupancy, reduction, device):
    klh._PLANS.clear()
    check("ce", N, D, C, DTYPES[dt], bias, None, device, reduction=reduction,
          config=LaunchConfig(occupancy=occupancy))
    assert {p.kind for p in klh._PLANS.values()} == {"small"}
    assert {p.constexprs["GH_T"] for p in klh._PLANS.values()} == {dt != "fp32" and C <= 256}


def test_small_ce_kernel_splits_rows_into_groups(device):
    # what SMALL_CE's N=1100 cases rely on: the launch really has several row groups
    h, w, b, y = make("ce", 1100, 64, 256, torch.float32, True, device)
    cfg = LaunchConfig(occupancy=0.5)
    gw, gb = torch.empty_like(w), torch.empty_like(b)
    hl = klh.prepare_launch(h, w, b, y, "ce", "mean", -100, cfg, gw, gb, False)
    assert hl.plan.kind == "small" and hl.ints[8] > 1  # n_groups (2 under the interpreter's 4 pretend SMs)


def test_small_ce_kernel_accumulates_and_is_deterministic(device):
    h, w, b, y = make("ce", 1100, 48, 130, torch.float32, True, device)
    gw0, gb0 = torch.randn_like(w), torch.randn_like(b)
    outs = []
    for _ in range(2):
        gw, gb = gw0.clone(), gb0.clone()
        loss, gh = local_head_into(h, w, b, y, loss="ce", reduction="mean", ignore_index=-100, backend="triton",
                                   config=LaunchConfig(occupancy=0.5), grad_weight=gw, grad_bias=gb, accumulate=True)
        outs.append((loss, gh, gw, gb))
    ref = reference.local_head(h, w, b, y, loss="ce")
    torch.testing.assert_close(outs[0][2], gw0 + ref.grad_weight, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(outs[0][3], gb0 + ref.grad_bias, rtol=1e-4, atol=1e-6)
    for x, z in zip(*outs):
        assert torch.equal(x, z)


@pytest.mark.parametrize("phases", [1, 2])
def test_small_ce_stopped_kernel_leaves_counters_clean(phases, monkeypatch, device):
    # PHASES < 3 (a profiling knob: the kernel stops after phase A or B) stops early; the next full
    # launch on the stream must still find its counters at zero
    h, w, b, y = make("ce", 1100, 48, 130, torch.float32, True, device)
    orig = klh._small_ce_blocks
    monkeypatch.setattr(klh, "_small_ce_blocks", lambda *a: {**orig(*a), "PHASES": phases})
    klh._PLANS.clear()
    functional._FAST.clear()
    fused_local_head(h, w, b, y, loss="ce", backend="triton", config=LaunchConfig(occupancy=0.5))
    monkeypatch.setattr(klh, "_small_ce_blocks", orig)
    klh._PLANS.clear()
    functional._FAST.clear()
    check("ce", 1100, 48, 130, torch.float32, True, None, device, config=LaunchConfig(occupancy=0.5))


def test_small_ce_all_rows_ignored(device):
    h, w, b, y = make("ce", 20, 16, 100, torch.float32, True, device)
    y.fill_(-100)
    out = fused_local_head(h, w, b, y, loss="ce", backend="triton")
    assert torch.isnan(out.loss)
    assert (out.grad_h == 0).all() and (out.grad_weight == 0).all() and (out.grad_bias == 0).all()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="stops a program of the interpreter")
def test_a_kernel_stopped_part_way_leaves_a_clean_workspace(monkeypatch):
    # under the interpreter an error inside a program stops the launch part-way; its phase counters
    # must not stay set, or the next launch on the workspace spins forever on them
    h, w, b, y = make("ce", 300, 48, 130, torch.float32, True, torch.device("cpu"))
    klh._PLANS.clear()
    functional._FAST.clear()
    calls = []

    def item_done_then_fail(ptr):
        calls.append(1)
        raise RuntimeError("stopped part-way")
    import erase_triton.kernels.small_ce as small_ce
    monkeypatch.setattr(small_ce, "item_done", item_done_then_fail)
    with pytest.raises(Exception, match="stopped part-way"):
        fused_local_head(h, w, b, y, loss="ce", backend="triton")
    monkeypatch.undo()
    ws = klh._workspace(torch.device("cpu"))
    assert calls and (ws.ctr == 0).all() and (ws.acc == 0).all()
    check("ce", 300, 48, 130, torch.float32, True, None, torch.device("cpu"))
