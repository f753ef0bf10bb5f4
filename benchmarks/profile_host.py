"""Host cost of one fused head call on a launch-bound size (GPU idle), with a cProfile
breakdown: where the microseconds go before the kernel reaches the GPU.

    python benchmarks/profile_host.py
"""
import cProfile
import pstats
import time

import torch

from erase_triton import LocalHead, fused_local_head


def main():
    h = torch.randn(1024, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    y = torch.rand(1024, device="cuda")
    head = LocalHead(128, 1).cuda().bfloat16()
    for name, fn in [("fused_local_head", lambda: fused_local_head(h, w, b, y)),
                     ("LocalHead (no producer)", lambda: head(h, y)),
                     ("torch.empty x2 (reference cost)", lambda: (torch.empty(1024, 128, device="cuda"),
                                                                  torch.empty(1, device="cuda")))]:
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        n = 3000
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        print(f"host_us {name}: {dt:.1f}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        fused_local_head(h, w, b, y)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
