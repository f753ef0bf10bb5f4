"""Erase against sequential (and e2e): one step timed alone vs a sustained run, with the SM clock and power.

    python benchmarks/probe_sustained.py [--out CSV] [--label NAME] [--rounds R] [--steps K] [--hold S]
                                         [--graphed] [--model mlp|ctr] [--configs W:B:DTYPE,...]
                                         [--modes sequential,erase] [--beside OCC[:PPS][:FIELD=INT],...]

bench_schedule's eager event rounds time one step of each variant, variants interleaved; its
wall-clock blocks (--wall-steps) time K consecutive steps of one variant between two syncs.
At w2048 b16384 the two disagree on erase / sequential (session 22: events 1.09, wall 1.03).
This probe times, for sequential and erase (forking every step) with fused heads (--modes adds e2e), in
rounds (--graphed: replays of each one's captured step instead):
  isolated   one step between two syncs, CUDA events around it (the GPU idle before it);
  sustained  K steps between two syncs: the wall clock a step, CUDA events around each step
             (the first step's left out), the host's time to issue a step, and the caching
             allocator's cudaMalloc / cudaFree calls and retries in the block.
Run it under different environments (--label names the run in the CSV; one CSV a run), e.g.
CUDA_DEVICE_MAX_CONNECTIONS=32 or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
--hold S: afterwards, each variant runs steps for S seconds at a time (each in turn, twice), with
nvidia-smi sampling the SM clock, power draw and throttle reasons every 50 ms; the rows get the
median clock and power inside each variant's windows (their first 0.3 s left out) and the time a step.
--model ctr: the DLRM-like CTR proxy of `erase-triton bench` (fp32 with TF32: DTYPE tf32) instead of the MLP proxy.
--beside: the LaunchConfig of the heads beside the next segment, as in bench_schedule (one pass over the
configs a setting; "" is the library's "auto"); rows carry it in column beside.
Each row's <mode>_over_erase_<timing> is that mode's time over erase's (a speedup of erase).
Session 22's finding (docs/results.md, "Sustained runs and the power cap"): from w1024 b16384 up, a run
holds the H200 at its 700 W cap and erase's clock drops 5-7%, so a lone step overstates its gain there.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_schedule import _config, _launch_configs  # noqa: E402
from common import metadata, print_table, write_csv  # noqa: E402

from erase_triton import Scheduler  # noqa: E402
from erase_triton.study import _step_runner, ctr_workload, mlp_workload, with_heads  # noqa: E402
from erase_triton.train import training_step  # noqa: E402

CONFIGS = [(2048, 16384, "tf32"), (2048, 16384, "bf16"), (1024, 16384, "tf32")]
MODES = ("e2e", "sequential", "erase")
TIMINGS = ("iso_ms", "sus_ev_ms", "sus_wall_ms")
STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _stats() -> dict:
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in STATS}


def _smi_samples(path: str) -> list[tuple[float, float, float, str]]:
    """(unix time, SM MHz, W, throttle reasons) of each nvidia-smi sample in path."""
    out = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 4:
                continue
            try:
                t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                out.append((t, float(parts[1]), float(parts[2]), parts[3]))
            except ValueError:
                continue
    return out


def held_stats(samples, windows, settle: float = 0.3) -> dict:
    """The time a step over a variant's held windows [(t0, t1, steps)], and the median SM clock
    and power and the most frequent throttle reasons of the samples inside them (each window's
    first `settle` seconds left out)."""
    out = dict(hold_ms_per_step=sum(t1 - t0 for t0, t1, _ in windows) * 1e3 / sum(n for *_, n in windows))
    inside = [smp for smp in samples for t0, t1, _ in windows if t0 + settle <= smp[0] <= t1]
    out["hold_samples"] = len(inside)
    if inside:
        out["sm_mhz"] = statistics.median(x[1] for x in inside)
        out["power_w"] = statistics.median(x[2] for x in inside)
        out["throttle"] = Counter(x[3] for x in inside).most_common(1)[0][0]
    return out


def hold(runs, seconds):
    """Each variant runs steps back to back for `seconds`, twice, alternating; returns
    {name: [(t0, t1, steps)]} (host clock) for matching with nvidia-smi's samples."""
    windows = {n: [] for n in runs}
    for name in list(runs) * 2:
        run = runs[name]
        torch.cuda.synchronize()
        t0, n = time.time(), 0
        while time.time() - t0 < seconds:
            run()
            n += 1
        torch.cuda.synchronize()
        windows[name].append((t0, time.time(), n))
    return windows


def build(model_name, width, batch, dname, beside=""):
    """(model, inputs) of one config with fused heads, the side heads launched per `beside`."""
    if model_name == "ctr":
        model, inputs = with_heads(ctr_workload, "fused", width, batch)
    else:
        dtype = {"tf32": torch.float32, "bf16": torch.bfloat16}[dname]
        model, inputs = with_heads(mlp_workload, "fused", width, batch, dtype)
    return _launch_configs(model, beside, ""), inputs


def probe(width, batch, dname, rounds, steps, hold_s=0.0, smi_log=None, graphed=False, model_name="mlp",
          modes=("sequential", "erase"), beside=""):
    model, inputs = build(model_name, width, batch, dname, beside)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = training_step(model, opt)
    variants = {m: Scheduler("erase", adaptive=False) if m == "erase" else Scheduler(m) for m in modes}

    # one step: a replay of the captured step, or an eager step in sched.step(); either warmed up
    runs = {n: _step_runner(s, step, inputs, graphed) for n, s in variants.items()}
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
        row = dict(model=model_name, width=width, batch=batch, dtype=dname, beside=beside,
                   exec="graph" if graphed else "eager", mode=name, forks=variants[name].last_forks)
        for k in TIMINGS + ("sus_host_ms",):
            row[k] = statistics.median(a[k])
        for k in STATS:
            row[k + "_per_block"] = sum(a[k]) / len(a[k])
        out.append(row)
    if hold_s > 0:
        windows = hold(runs, hold_s)
        time.sleep(0.2)  # nvidia-smi's last samples
        samples = _smi_samples(smi_log)
        for row in out:
            row.update(held_stats(samples, windows[row["mode"]]))
    er = next(r for r in out if r["mode"] == "erase")
    for r in out:
        if r is not er:
            short = "seq" if r["mode"] == "sequential" else r["mode"]
            for k in TIMINGS + (("hold_ms_per_step",) if hold_s > 0 else ()):
                er[f"{short}_over_erase_{k}"] = r[k] / er[k]
    del model, inputs
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/eager_sustained.csv")
    ap.add_argument("--label", default="default", help="names this run's environment in the CSV")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10, help="steps in a sustained block (K >= 2)")
    ap.add_argument("--hold", type=float, default=0.0, help="seconds a held window (0: none); needs nvidia-smi")
    ap.add_argument("--graphed", action="store_true", help="replays of each variant's captured step instead of eager steps")
    ap.add_argument("--model", default="mlp", choices=("mlp", "ctr"), help="the MLP proxy or the CTR proxy")
    ap.add_argument("--configs", default=",".join(f"{w}:{b}:{d}" for w, b, d in CONFIGS),
                    help="configs WIDTH:BATCH:tf32|bf16, comma-separated (the CTR proxy: tf32 only)")
    ap.add_argument("--modes", default="sequential,erase", help="comma-separated, of e2e,sequential,erase; erase and one more")
    ap.add_argument("--beside", default="", help="OCC[:PPS][:FIELD=INT],...: the side heads' LaunchConfig per pass, "
                    "as in bench_schedule ('' = the library's)")
    args = ap.parse_args()
    modes = [m for m in MODES if m in args.modes.split(",")]
    if set(args.modes.split(",")) - set(MODES) or "erase" not in modes or len(modes) < 2:
        ap.error(f"--modes takes erase and one or both of e2e,sequential, comma-separated; got {args.modes!r}")
    besides = args.beside.split(",")
    for b in besides:
        try:
            if b:
                _config(b)
        except (ValueError, TypeError) as e:
            ap.error(f"--beside takes OCC[:PPS][:FIELD=INT],... (e.g. 0.25 or 0.125:two_pass=1), got {b!r}: {e}")
    if args.steps < 2:
        ap.error(f"--steps must be >= 2 (the first step of a block is left out of its events), got {args.steps}")
    try:
        configs = [(int(w), int(b), d) for w, b, d in (c.split(":") for c in args.configs.split(","))]
    except ValueError:
        ap.error(f"--configs takes WIDTH:BATCH:DTYPE,... (e.g. 2048:16384:tf32), got {args.configs!r}")
    if any(d not in ("tf32", "bf16") for *_, d in configs):
        ap.error(f"--configs: the dtype of each config must be tf32 or bf16, got {args.configs!r}")
    if args.model == "ctr" and any(d != "tf32" for *_, d in configs):
        ap.error(f"--configs: the CTR proxy runs in fp32 with TF32, so each config's dtype must be tf32, got {args.configs!r}")
    if not torch.cuda.is_available():
        sys.exit("probe_sustained.py needs a CUDA device (it times streams and the caching allocator)")
    torch.backends.cuda.matmul.allow_tf32 = True
    env = {k: os.environ.get(k, "") for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")}
    rows = []
    smi, smi_log = None, None
    if args.hold > 0:
        smi_log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
        try:
            smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active",
                                    "--format=csv,noheader,nounits", "-lms", "50", "-f", smi_log])
        except FileNotFoundError:
            ap.error("--hold samples the SM clock and power with nvidia-smi, which is not on PATH")
    try:
        for bs in besides:
            for w, b, d in configs:
                for r in probe(w, b, d, args.rounds, args.steps, args.hold, smi_log, args.graphed, args.model,
                               modes, bs):
                    rows.append(dict(label=args.label, **env, **r))
                    print(rows[-1], flush=True)
    finally:
        if smi is not None:
            smi.terminate()
            smi.wait(timeout=10)
            os.unlink(smi_log)
    write_csv(args.out, rows, metadata())
    ratios = [f"{'seq' if m == 'sequential' else m}_over_erase_{k}" for m in modes if m != "erase"
              for k in TIMINGS + ("hold_ms_per_step",)]
    print_table(rows, ["label", "model", "width", "batch", "dtype", "beside", "exec", "mode", "forks", "iso_ms",
                       "sus_ev_ms", "sus_wall_ms", "sus_host_ms", "num_device_alloc_per_block",
                       "num_alloc_retries_per_block", "hold_ms_per_step", "sm_mhz", "power_w", "throttle", *ratios])


if __name__ == "__main__":
    main()
