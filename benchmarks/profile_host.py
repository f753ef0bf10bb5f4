"""Host cost of one fused head call on a launch-bound size (GPU idle), with a breakdown:
where the microseconds go before the kernel reaches the GPU.

    python benchmarks/profile_host.py
"""
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_us  # noqa: E402

from erase_triton import LocalHead, fused_local_head  # noqa: E402
from erase_triton import functional as fn  # noqa: E402


def main():
    h = torch.randn(1024, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    y = torch.rand(1024, device="cuda")
    head = LocalHead(128, 1).cuda().bfloat16()
    head(h, y)  # .grad now exists: later calls accumulate (the steady state of training)
    fused_local_head(h, w, b, y)
    gw, gb = torch.empty_like(w), torch.empty_like(b)
    cfg = fn._config(None)  # what fused_local_head(occupancy=None) launches with
    key = fn._signature(h, w, b, y, gw, gb, "bce", "mean", -100, cfg, False)
    hl = fn._FAST[key][0]
    dev = h.device
    parts = [
        ("fused_local_head (allocates 4 outputs)", lambda: fused_local_head(h, w, b, y)),
        ("LocalHead.forward, no producer, .grad accumulated", lambda: head(h, y)),
        ("  signature key", lambda: fn._signature(h, w, b, y, gw, gb, "bce", "mean", -100, cfg, False)),
        ("  HeadLaunch call (2 torch.empty + launch)", lambda: hl(h, w, b, y, gw, gb)),
        ("  torch.empty x2", lambda: (torch.empty((1024, 128), dtype=torch.bfloat16, device=dev),
                                      torch.empty((), dtype=torch.float32, device=dev))),
    ]
    for name, f in parts:
        print(f"host_us {name}: {host_us(f, n=5000, warmup=200):.1f}", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        fused_local_head(h, w, b, y)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
