"""A few calls of one fused head, for Nsight Compute (the last one is the one to profile).

    ncu --clock-control none -k regex:_small_ce --launch-skip 4 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy \\
        python3 benchmarks/ncu_head.py --loss ce --N 8192 --D 512 --C 256 --occupancy 0.125

Five calls: the first compiles and plans, the next three warm up, the fifth is profiled.
"""
from __future__ import annotations

import argparse

import torch

from erase_triton import LaunchConfig, fused_local_head


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loss", default="ce", choices=["bce", "ce", "mse"])
    ap.add_argument("--N", type=int, default=8192)
    ap.add_argument("--D", type=int, default=512)
    ap.add_argument("--C", type=int, default=256)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--occupancy", type=float, default=None)
    args = ap.parse_args()
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(args.N, args.D, device="cuda", generator=g).to(dt)
    w = (torch.randn(args.C, args.D, device="cuda", generator=g) / args.D ** 0.5).to(dt)
    b = torch.zeros(args.C, device="cuda", dtype=dt)
    if args.loss == "ce":
        y = torch.randint(0, args.C, (args.N,), device="cuda", generator=g)
    else:
        y = torch.rand(args.N, args.C, device="cuda", generator=g).round().to(dt)
    cfg = LaunchConfig(occupancy=args.occupancy)
    for _ in range(5):
        fused_local_head(h, w, b, y, loss=args.loss, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
