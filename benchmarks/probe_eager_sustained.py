"""Why eager erase gains less in a sustained run than one step timed alone (session 22).

    python benchmarks/probe_eager_sustained.py [--out CSV] [--label NAME] [--rounds R] [--steps K]

bench_schedule's eager event rounds time one step of each variant, variants interleaved; its
wall-clock blocks (--wall-steps) time K consecutive steps of one variant between two syncs.
At w2048 b16384 the two disagree on erase / sequential (session 22: events 1.09, wall 1.03).
This probe times, for sequential and erase (forking every step) with fused heads, in rounds:
  isolated   one step between two syncs, CUDA events around it (the GPU idle before it);
  sustained  K steps between two syncs: the wall clock a step, CUDA events around each step
             (the first step's left out), the host's time to issue a step, and the caching
             allocator's cudaMalloc / cudaFree calls and retries in the block.
Run it under different environments (--label names the run in the CSV; one CSV a run), e.g.
CUDA_DEVICE_MAX_CONNECTIONS=32 or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata, print_table, write_csv  # noqa: E402

from erase_triton import Scheduler  # noqa: E402
from erase_triton.study import mlp_workload, with_heads  # noqa: E402
from erase_triton.train import training_step  # noqa: E402

CONFIGS = [(2048, 16384, "tf32"), (2048, 16384, "bf16"), (1024, 16384, "tf32")]
STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _stats() -> dict:
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in STATS}


def probe(width, batch, dname, rounds, steps):
    dtype = {"tf32": torch.float32, "bf16": torch.bfloat16}[dname]
    model, inputs = with_heads(mlp_workload, "fused", width, batch, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = training_step(model, opt)
    variants = {"sequential": Scheduler("sequential"), "erase": Scheduler("erase", adaptive=False)}

    def runner(sched):
        def run():
            with sched.step():
                step(*inputs)
        return run
    runs = {n: runner(s) for n, s in variants.items()}
    for run in runs.values():
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    acc = {n: {k: [] for k in ("iso_ms", "sus_ev_ms", "sus_wall_ms", "sus_host_ms") + STATS} for n in runs}
    order, rng = list(runs), random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            run, a = runs[name], acc[name]
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            torch.cuda.synchronize()
            a["iso_ms"].append(s.elapsed_time(e))
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
            st0 = _stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host = 0.0
            for s, e in ev:
                s.record()
                h = time.perf_counter()
                run()
                host += time.perf_counter() - h
                e.record()
            torch.cuda.synchronize()
            a["sus_wall_ms"].append((time.perf_counter() - t0) * 1e3 / steps)
            a["sus_host_ms"].append(host * 1e3 / steps)
            a["sus_ev_ms"].append(statistics.median(s.elapsed_time(e) for s, e in ev[1:]))
            st1 = _stats()
            for k in STATS:
                a[k].append(st1[k] - st0[k])
    out = []
    for name, a in acc.items():
        row = dict(width=width, batch=batch, dtype=dname, mode=name, forks=variants[name].last_forks)
        for k in ("iso_ms", "sus_ev_ms", "sus_wall_ms", "sus_host_ms"):
            row[k] = statistics.median(a[k])
        for k in STATS:
            row[k + "_per_block"] = sum(a[k]) / len(a[k])
        out.append(row)
    seq, er = out
    for k in ("iso_ms", "sus_ev_ms", "sus_wall_ms"):
        er["seq_over_erase_" + k] = seq[k] / er[k]
    del model, inputs
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/eager_sustained.csv")
    ap.add_argument("--label", default="default", help="names this run's environment in the CSV")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10, help="steps in a sustained block (K >= 2)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error(f"--steps must be >= 2 (the first step of a block is left out of its events), got {args.steps}")
    if not torch.cuda.is_available():
        sys.exit("probe_eager_sustained.py needs a CUDA device (it times streams and the caching allocator)")
    torch.backends.cuda.matmul.allow_tf32 = True
    env = {k: os.environ.get(k, "") for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")}
    rows = []
    for w, b, d in CONFIGS:
        for r in probe(w, b, d, args.rounds, args.steps):
            rows.append(dict(label=args.label, **env, **r))
            print(rows[-1], flush=True)
    write_csv(args.out, rows, metadata())
    print_table(rows, ["label", "width", "batch", "dtype", "mode", "forks", "iso_ms", "sus_ev_ms", "sus_wall_ms",
                       "sus_host_ms", "num_device_alloc_per_block", "num_alloc_retries_per_block",
                       "seq_over_erase_iso_ms", "seq_over_erase_sus_ev_ms", "seq_over_erase_sus_wall_ms"])


if __name__ == "__main__":
    main()
