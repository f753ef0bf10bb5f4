"""Where a CTR proxy step spends device time: kernel totals per step from torch.profiler,
grouped into embedding / optimizer / dense / head, for e2e and erase.

    python benchmarks/profile_ctr.py [--sizes 256x8192,1024x16384] [--embedding table|fused_sgd]
"""
from __future__ import annotations

import argparse
import collections

import torch

from erase_triton.scheduler import Scheduler
from erase_triton.study import _step_runner, ctr_workload
from erase_triton.train import training_step


def group(name: str) -> str:
    n = name.lower()
    if "embedding" in n or "index" in n or "sort" in n or "scatter" in n or "radix" in n or "segment" in n \
            or "unique" in n or "gather" in n or "cub" in n:
        return "embedding"
    if "foreach" in n or "multi_tensor" in n or "sgd" in n:
        return "optimizer"
    if "head_kernel" in n or "vocab_ce" in n:
        return "head"
    if "gemm" in n or "sm90" in n or "cutlass" in n or "nvjet" in n:
        return "matmul"
    if "fill" in n or "zero" in n:
        return "fill"
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256x8192,1024x16384")
    ap.add_argument("--embedding", default="table")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    for size in args.sizes.split(","):
        w, b = map(int, size.split("x"))
        for mode in ("e2e", "erase"):
            model, inputs = ctr_workload(w, b, embedding=args.embedding)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            sched = Scheduler(mode)
            run = _step_runner(sched, training_step(model, opt), inputs, graphed=False)  # warms up
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    run()
                torch.cuda.synchronize()
            per_kernel = collections.Counter()
            for e in prof.key_averages():
                if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[e.key] += e.device_time_total / args.steps
            groups = collections.Counter()
            for k, t in per_kernel.items():
                groups[group(k)] += t
            total = sum(groups.values())
            print(f"\n== CTR w{w} b{b} {mode} ({args.embedding}): kernel time per step {total / 1e3:.2f} ms  " +
                  "  ".join(f"{g} {t / 1e3:.2f}" for g, t in groups.most_common()))
            for k, t in per_kernel.most_common(8):
                print(f"   {t / 1e3:7.3f} ms  [{group(k)}] {k[:110]}")


if __name__ == "__main__":
    main()
