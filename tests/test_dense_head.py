"""The dense head kernel (kernels/dense_head.py: BCE/MSE and CE with C <= 64): its tile rules, the
atomic and two-pass modes, row tiles narrower than a warp, against the float64 reference."""

import pytest
import triton
import torch

import erase_triton.functional as functional
import erase_triton.kernels.plan as klh
from erase_triton import LaunchConfig, fused_local_head, reference
from erase_triton.functional import local_head_into
from head_checks import DTYPES, check, make, poison  # noqa: F401  (poison: the autouse fixture)


@pytest.mark.parametrize("loss,N,D,dt,det,relu", [("bce", 37, 2048, "fp32", False, None), ("mse", 21, 1500, "bf16", True, "relu"),
                                                   ("bce", 9, 4096, "bf16", True, "relu")])
def test_wide_rows_c1_one_tile(loss, N, D, dt, det, relu, device):
    # C=1 heads keep whole rows in one tile up to D=4096 (h read once), in both the atomic and the
    # fixed-order mode; a wider C or D goes back to D-chunks
    klh._PLANS.clear()
    check(loss, N, D, 1, DTYPES[dt], True, None, device, config=LaunchConfig(deterministic=det), activation=relu)
    plan, = klh._PLANS.values()
    assert plan.constexprs["SINGLE_CHUNK"] and plan.constexprs["BLOCK_D"] == triton.next_power_of_2(D)
    assert plan.constexprs["ATOMIC"] == (not det)
    assert not klh._dense_blocks(8192, 1, LaunchConfig(), True, True, 2)["SINGLE_CHUNK"]
    assert not klh._dense_blocks(2048, 2, LaunchConfig(), True, True, 2)["SINGLE_CHUNK"]
    bf16, fp32 = (klh._dense_blocks(2048, 1, LaunchConfig(), True, False, e) for e in (2, 4))
    assert (bf16["BLOCK_N"], bf16["num_warps"]) == (4, 2)  # 8192 elements a tile, as 8 rows of 1024
    assert (fp32["BLOCK_N"], fp32["num_warps"], fp32["NUM_STAGES"]) == (2, 4, 1)  # fp32: 4096 on 4 warps


TWO_PASS = [("bce", 781, 130, "fp32", True, None, 4), ("mse", 63, 512, "bf16", False, "relu", None),
            ("bce", 100, 64, "fp16", True, "relu", 2), ("mse", 1, 50, "fp32", True, None, None)]


@pytest.mark.parametrize("loss,N,D,dt,bias,relu,block_n", TWO_PASS,
                         ids=[f"{c[0]}-N{c[1]}-D{c[2]}-{c[3]}-{c[5]}" for c in TWO_PASS])
def test_two_pass_matches_reference(loss, N, D, dt, bias, relu, block_n, device):
    # LaunchConfig(two_pass=True): a program's tiles are read twice (dz into the workspace, then
    # grad_h and grad_W), every program several tiles (occupancy 1/2); the workspace starts as NaN
    klh._PLANS.clear()
    cfg = LaunchConfig(occupancy=0.5, deterministic=False, block_n=block_n, two_pass=True)
    check(loss, N, D, 1, DTYPES[dt], bias, None, device, config=cfg, activation=relu)
    plan, = klh._PLANS.values()
    assert plan.constexprs["TWO_PASS"] and plan.constexprs["STRIDED"]
    assert all(not ws.acc.any() for ws in klh._WORKSPACES.values())
    assert all(not ws.ctr.any() for ws in klh._WORKSPACES.values())


def test_two_pass_writes_relu_and_needs_the_atomic_c1_path(device):
    h, w, b, y = make("bce", 45, 130, 1, torch.float32, True, device)
    kw = dict(loss="bce", reduction="mean", ignore_index=-100, backend="triton", accumulate=False, activation="relu")
    outs = []
    for two_pass in (False, True):
        klh._PLANS.clear()
        act = torch.full_like(h, float("nan"))
        gw, gb = torch.empty_like(w), torch.empty_like(b)
        cfg = LaunchConfig(occupancy=0.5, deterministic=False, block_n=4, two_pass=two_pass)
        outs.append(local_head_into(h, w, b, y, config=cfg, grad_weight=gw, grad_bias=gb, act_out=act, **kw)
                    + (gw, gb))
        assert torch.equal(act, torch.relu(h)), "act_out != relu(h)"
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0)  # grad_h: the same per-row math
    for a, c in zip(outs[0], outs[1]):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)  # sums: another order
    h3, w3, b3, y3 = make("bce", 8, 16, 3, torch.float32, True, device)
    for cfg, what in ((LaunchConfig(deterministic=True, two_pass=True), "deterministic=True"),
                      (LaunchConfig(deterministic=False, two_pass=True, group_tiles=2), "group_tiles=2")):
        with pytest.raises(ValueError, match=f"two_pass=True needs a C=1 head.*{what}"):
            fused_local_head(h, w, b, y, backend="triton", config=cfg)
    with pytest.raises(ValueError, match="two_pass=True needs a C=1 head.*C=3"):
        fused_local_head(h3, w3, b3, y3, backend="triton", config=LaunchConfig(deterministic=False, two_pass=True))
    with pytest.raises(ValueError, match="two_pass must be a bool"):
        LaunchConfig(two_pass=1)


def test_relu_chunked_dense_head(device):
    # a weight wider than one tile: the dense kernel's D-chunk loops (both h loads, both stores)
    check("mse", 63, 130, 17, torch.float32, True, None, device, config=LaunchConfig(block_d=32),
          activation="relu")


@pytest.mark.parametrize("loss,block_n,num_warps,stages", [("bce", 2, 1, 2), ("mse", 1, 2, 1), ("bce", 4, 4, 3)])
def test_narrow_row_tiles_c1(loss, block_n, num_warps, stages, device):
    # C == 1 whole-row tiles take no tl.dot, so row tiles below 16 are allowed (the bandwidth tuning grid)
    cfg = LaunchConfig(block_n=block_n, num_warps=num_warps, num_stages=stages)
    check(loss, 37, 130, 1, torch.float32, True, None, device, config=cfg)


@pytest.mark.parametrize("group_tiles", [1, 3])
def test_small_partial_groups(group_tiles, device):
    # more grad_W partial groups than programs: every program claims several groups
    cfg = LaunchConfig(block_n=4, group_tiles=group_tiles)
    check("bce", 63, 50, 1, torch.float32, True, 0.25, device, config=cfg)


@pytest.mark.parametrize("loss,N,D,C,bias,group_tiles", [("bce", 781, 130, 1, True, None), ("mse", 63, 50, 17, False, 2),
                                                          ("ce", 100, 16, 17, True, 1), ("bce", 1, 1, 3, True, None)])
def test_atomic_mode_matches_reference(loss, N, D, C, bias, group_tiles, device):
    # deterministic=False: float atomics instead of phase R; the accumulator is left at zero
    cfg = LaunchConfig(deterministic=False, block_n=4 if C == 1 else None, group_tiles=group_tiles)
    check(loss, N, D, C, torch.float32, bias, 0.5, device, config=cfg)
    check(loss, N, D, C, torch.bfloat16, bias, 0.5, device, config=cfg)  # twice: the accumulator was re-zeroed
    assert all(not ws.acc.any() for ws in klh._WORKSPACES.values())
    assert all(not ws.ctr.any() for ws in klh._WORKSPACES.values())


@pytest.mark.parametrize("strided,copies", [(True, 1), (False, 4), (True, 2)])
def test_atomic_mode_strided_tiles_and_accumulator_copies(strided, copies, monkeypatch, device):
    # the atomic kernel's tuning levers: a static tile stride (no claims) and several accumulators
    orig = klh._dense_blocks
    monkeypatch.setattr(klh, "_dense_blocks", lambda *a: {**orig(*a), "STRIDED": strided, "ACC_COPIES": copies})
    klh._PLANS.clear()
    functional._FAST.clear()
    try:
        cfg = LaunchConfig(deterministic=False, block_n=4)
        check("bce", 781, 130, 1, torch.float32, True, 0.5, device, config=cfg)
        check("mse", 63, 50, 3, torch.float32, False, 1.0, device, config=LaunchConfig(deterministic=False))
        assert all(not ws.acc.any() for ws in klh._WORKSPACES.values())
        assert all(not ws.ctr.any() for ws in klh._WORKSPACES.values())
        if strided:
            h, w, b, y = make("bce", 8, 4, 1, torch.float32, True, device)
            with pytest.raises(ValueError, match="STRIDED"):
                fused_local_head(h, w, b, y, backend="triton", config=LaunchConfig(deterministic=True))
    finally:
        klh._PLANS.clear()
        functional._FAST.clear()


def test_atomic_mode_accumulates_and_falls_back(device):
    # into existing .grad; and a head whose weight needs several D chunks stays deterministic
    h, w, b, y = make("bce", 63, 50, 3, torch.float32, True, device)
    gw0, gb0 = torch.randn_like(w), torch.randn_like(b)
    gw, gb = gw0.clone(), gb0.clone()
    local_head_into(h, w, b, y, loss="bce", reduction="mean", ignore_index=-100, backend="triton",
                    config=LaunchConfig(deterministic=False), grad_weight=gw, grad_bias=gb, accumulate=True)
    ref = reference.local_head(h, w, b, y, loss="bce")
    torch.testing.assert_close(gw, gw0 + ref.grad_weight, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gb, gb0 + ref.grad_bias, rtol=1e-4, atol=1e-6)
    assert not klh.plan_for("bce", "mean", 3, 4096, torch.float32, True, False, LaunchConfig(deterministic=False),
                         False, True, "ieee", False).constexprs["ATOMIC"]
    check("bce", 40, 130, 3, torch.float32, True, None, device, config=LaunchConfig(deterministic=False, block_d=32))


def test_narrow_row_tiles_need_c1(device):
    h, w, b, y = make("bce", 8, 4, 3, torch.float32, True, device)
    with pytest.raises(ValueError, match="block_n must be >= 16 when C > 1"):
        fused_local_head(h, w, b, y, backend="triton", config=LaunchConfig(block_n=8))
    h, w, b, y = make("ce", 8, 4, 100, torch.float32, True, device)
    with pytest.raises(ValueError, match="block_n must be >= 16 for the small-vocabulary CE kernel"):
        fused_local_head(h, w, b, y, loss="ce", backend="triton", config=LaunchConfig(block_n=8))
    h, w, b, y = make("ce", 8, 4, 600, torch.float32, True, device)
    with pytest.raises(ValueError, match="block_n must be >= 16 for the vocabulary kernel"):
        fused_local_head(h, w, b, y, loss="ce", backend="triton", config=LaunchConfig(block_n=8))
