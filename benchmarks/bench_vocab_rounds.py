"""The vocabulary CE head at one shape in interleaved rounds: ours (the default, chunk sizes, no bias) against
eager PyTorch and torch.compile of the same.

    python benchmarks/bench_vocab_rounds.py [--shape 4096:4096:128256] [--rounds 7] [--chunks 1024,2048]
        [--out benchmarks/results/vocab_rounds.csv]

At (4096, 4096, 128256) a single run moves by +-0.7 ms with the GPU's clocks, more than the chunk sizes
differ; every round times each variant once, in a rotated order, so the variants share the drift. Each
round gives do_bench's median (ms) and the kernel time of one call (torch profiler over three calls).
The summary: medians and ranges, and the median over rounds of ours over eager and over torch.compile
(a paired estimate: a ratio within one round cancels drift slower than the round).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_local_head import make, ours_fn, torch_fn  # noqa: E402

from erase_triton import LaunchConfig  # noqa: E402
from erase_triton.bench import metadata, print_table, write_csv  # noqa: E402
from erase_triton.reference import head_loss  # noqa: E402


def kernel_ms(fn, n: int = 3) -> float:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / n / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096:4096:128256", help="N:D:V")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunks", default="1024,2048", help="chunk sizes (rows) besides the default's")
    ap.add_argument("--out", default="benchmarks/results/vocab_rounds.csv")
    args = ap.parse_args()
    try:
        N, D, C = (int(x) for x in args.shape.split(":"))
        chunks = [int(x) for x in args.chunks.split(",") if x]
        assert min(N, D, C, *chunks) > 0
    except (ValueError, AssertionError):
        ap.error(f"--shape N:D:V and --chunks A,B,...: expected positive integers, "
                 f"got {args.shape!r} and {args.chunks!r}")
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive integer, got {args.rounds}")
    if not torch.cuda.is_available():
        sys.exit("bench_vocab_rounds.py times CUDA kernels: no CUDA device here")
    import triton

    h, w, b, y = make("ce", N, D, C, torch.bfloat16)
    comp = torch.compile(lambda hh, ww, bb, yy: head_loss(F.linear(hh, ww, bb), yy, "ce", "mean", -100))
    variants = {"torch": torch_fn("ce", h, w, b, y), "torch.compile": torch_fn("ce", h, w, b, y, compiled=comp),
                "ours": ours_fn("ce", h, w, b, y)}
    for cs in chunks:
        variants[f"ours chunk_size={cs}"] = ours_fn("ce", h, w, b, y, LaunchConfig(vocab_path="cublas", chunk_size=cs))
    variants["ours bias=None"] = ours_fn("ce", h, w, None, y)
    for fn in variants.values():  # compile, plan, allocate
        fn()
    names = list(variants)
    rows = []
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            fn = variants[name]
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            rows.append(dict(N=N, D=D, C=C, round=rnd, variant=name, ms=ms, kernel_ms=kernel_ms(fn)))
        print(f"round {rnd}: " + ", ".join(f"{r['variant']} {r['ms']:.2f}" for r in rows[-len(names):]), flush=True)
    meta = metadata()
    meta["command"] = "bench_vocab_rounds.py " + " ".join(sys.argv[1:])
    write_csv(args.out, rows, meta)
    per = {n: [r for r in rows if r["variant"] == n] for n in names}
    summary = []
    for n in names:
        ms = [r["ms"] for r in per[n]]
        s = dict(variant=n, median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms),
                 kernel_ms=statistics.median(r["kernel_ms"] for r in per[n]))
        for base in ("torch", "torch.compile"):
            s[f"over_{base}"] = statistics.median(a["ms"] / c["ms"] for a, c in zip(per[n], per[base]))
        summary.append(s)
    print_table(summary, ["variant", "median_ms", "min_ms", "max_ms", "kernel_ms", "over_torch", "over_torch.compile"])


if __name__ == "__main__":
    main()
