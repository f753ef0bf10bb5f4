"""Data-parallel ERASE: examples/s of e2e / sequential / erase under `data_parallel`, scaling
against one GPU, and whether segment k's all-reduce starts before segment k+1's forward ends.

    torchrun --nproc_per_node 1 benchmarks/bench_data_parallel.py --out DIR/dp_1.csv
    torchrun --nproc_per_node 2 benchmarks/bench_data_parallel.py --out DIR/dp_2.csv
    python3 benchmarks/bench_data_parallel.py --summary DIR/dp_1.csv DIR/dp_2.csv --out DIR/data_parallel.csv

Each rank runs the MLP proxy (six blocks, BCE heads) and the CTR proxy (fused-SGD tables, six
subarchitectures) at widths 512, 2048 and 4096 with `--batch` rows per rank, graphed (one CUDA
graph a step, the regime the scheduler is for; --eager for host-issued steps). Step times are
CUDA-event medians on every rank, and a row keeps the slowest rank's. Rank 0 writes the CSV.
--trace: one eager erase step of the CTR proxy profiled on rank 0; the row `overlap` says, for
each segment k, whether its all-reduce kernel started before segment k+1's last forward kernel ended.
On CPU (gloo) it runs tiny sizes to show the pipeline; the numbers then mean nothing.
The summary joins a 1-rank and an N-rank file: scaling = examples/s at N / at 1, and erase over
e2e at N against the same ratio at 1.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from erase_triton import Scheduler
from erase_triton.bench import (ctr_workload, metadata, mlp_workload, print_table, read_csv, step_runner,
                                tf32_metadata, write_csv)
from erase_triton.distributed import data_parallel, launch_from_env
from erase_triton.train import training_step

MODES = ("e2e", "sequential", "erase")


def _slowest(ms: float, device) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def time_mode(build, mode: str, graphed: bool, iters: int, device) -> float:
    model, inputs = build()
    data_parallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    run = step_runner(Scheduler(mode), training_step(model, opt), inputs, graphed)
    cuda = device.type == "cuda"
    ts = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            import time
            t = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def overlap_check(build, device) -> str:
    """One eager erase step profiled: 'k:yes' where segment k's all-reduce kernel starts before
    segment k+1's last forward kernel ends."""
    model, inputs = build()
    data_parallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    sched = Scheduler("erase", adaptive=False)  # every detach point forks
    step = training_step(model, opt)
    for _ in range(3):
        with sched.step():
            step(*inputs)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        with sched.step():
            step(*inputs)
        torch.cuda.synchronize()
    evs = list(prof.profiler.kineto_results.events())
    ranges, launches, kernels = {}, {}, []
    for e in evs:
        name = e.name()
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            kernels.append(e)
        elif name.startswith("erase::"):
            kind, seg = name.split("::")[1].split(" ")
            ranges[(kind, seg)] = (e.start_ns(), e.start_ns() + e.duration_ns())
        elif "LaunchKernel" in name or "cuLaunch" in name:
            launches[e.correlation_id()] = e.start_ns()
    out = []
    segs = sorted(int(s) for k, s in ranges if k == "backward")
    for k in segs[:-1]:
        ar = ranges.get(("allreduce", str(k)))
        nxt_fwd_start = ranges[("backward", str(k))][1]
        nxt_fwd_end = ranges[("backward", str(k + 1))][0]
        if ar is None:
            out.append(f"{k}:no-allreduce")
            continue
        ar_kernels = [e for e in kernels if "nccl" in e.name().lower() and ar[0] <= launches.get(e.correlation_id(), -1) <= ar[1]]
        fwd = [e for e in kernels if "nccl" not in e.name().lower()
               and nxt_fwd_start <= launches.get(e.correlation_id(), -1) <= nxt_fwd_end]
        if not ar_kernels or not fwd:
            out.append(f"{k}:unseen")
            continue
        starts = min(e.start_ns() for e in ar_kernels)
        fwd_end = max(e.start_ns() + e.duration_ns() for e in fwd)
        out.append(f"{k}:{'yes' if starts < fwd_end else 'no'}")
    return " ".join(out)


def summary(paths: list[str], out: str):
    rows = [r for p in paths for r in read_csv(p)]
    key = lambda r: (r["model"], r["width"], r["batch"], r["exec"])  # noqa: E731
    by = {}
    for r in rows:
        by.setdefault(key(r), {})[(int(r["world_size"]), r["mode"])] = float(r["examples_per_s"])
    res = []
    for k, v in sorted(by.items()):
        worlds = sorted({w for w, _ in v})
        if len(worlds) < 2 or worlds[0] != 1:
            continue
        n = worlds[-1]
        s = dict(model=k[0], width=k[1], batch_per_gpu=k[2], exec=k[3], world_size=n)
        for m in MODES:
            if (1, m) in v and (n, m) in v:
                s[f"scaling_{m}"] = v[(n, m)] / v[(1, m)]
        if (1, "e2e") in v and (1, "erase") in v and (n, "e2e") in v and (n, "erase") in v:
            s["erase_over_e2e_1"] = v[(1, "erase")] / v[(1, "e2e")]
            s[f"erase_over_e2e_{n}"] = v[(n, "erase")] / v[(n, "e2e")]
            s["change"] = s[f"erase_over_e2e_{n}"] - s["erase_over_e2e_1"]
        res.append(s)
    write_csv(out, res, metadata())
    print_table(res, list(res[0]) if res else [])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--widths", default="512,2048,4096")
    ap.add_argument("--batch", type=int, default=16384, help="rows a rank a step")
    ap.add_argument("--models", default="mlp,ctr")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--eager", action="store_true", help="host-issued steps instead of CUDA graphs")
    ap.add_argument("--trace", action="store_true", help="profile one erase step of the CTR proxy (rank 0)")
    ap.add_argument("--summary", nargs="+", metavar="CSV", help="join a 1-rank and an N-rank file")
    a = ap.parse_args()
    if a.summary:
        return summary(a.summary, a.out)
    try:
        widths = [int(w) for w in a.widths.split(",")]
    except ValueError:
        raise SystemExit(f"--widths: expected integers separated by commas, got {a.widths!r}") from None
    if a.batch < 1 or a.iters < 1:
        raise SystemExit("--batch and --iters must be positive")
    models = a.models.split(",")
    if not set(models) <= {"mlp", "ctr"}:
        raise SystemExit(f"--models takes mlp and/or ctr, got {a.models!r}")
    launch = launch_from_env()
    if launch is None:
        raise SystemExit("run it under torchrun (torchrun --nproc_per_node N benchmarks/bench_data_parallel.py ...)")
    dev = torch.device(launch.device)
    cuda = dev.type == "cuda"
    meta = tf32_metadata() if cuda else metadata()
    meta["world_size"] = launch.world_size
    if not cuda:  # the pipeline on CPU: tiny sizes
        widths, a.batch, a.iters = [32], 64, 3
    graphed = cuda and not a.eager
    rows = []
    for model_name in models:
        for w in widths:
            if model_name == "mlp":
                build = lambda w=w: mlp_workload(w, a.batch, torch.float32, device=dev)  # noqa: E731
            else:
                build = lambda w=w: ctr_workload(w, a.batch, device=dev, rows=100_000 if cuda else 1000)  # noqa: E731
            for mode in MODES:
                ms = _slowest(time_mode(build, mode, graphed, a.iters, dev), dev)
                r = dict(model=model_name, width=w, batch=a.batch, exec="graph" if graphed else "eager", mode=mode,
                         world_size=launch.world_size, ms=ms, examples_per_s=a.batch * launch.world_size / ms * 1e3)
                rows.append(r)
                if launch.rank == 0:
                    print(r, flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if a.trace and cuda:
        check = overlap_check(lambda: ctr_workload(2048, a.batch, device=dev), dev)
        rows.append(dict(model="ctr", width=2048, batch=a.batch, exec="eager", mode="erase",
                         world_size=launch.world_size, overlap=check))
    if launch.rank == 0:
        write_csv(a.out, rows, meta)
        print_table(rows, ["model", "width", "batch", "exec", "mode", "world_size", "ms", "examples_per_s", "overlap"])
    launch.close()


if __name__ == "__main__":
    main()
