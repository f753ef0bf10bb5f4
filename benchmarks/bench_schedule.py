"""Step time of e2e / sequential / erase x eager / graphed x PyTorch heads / fused heads.

    python benchmarks/bench_schedule.py [--model mlp|transformer|all] [--quick]

MLP proxy of DESIGN.md (six blocks of two Linear+ReLU, width w, batch b, BCE heads,
SGD) in tf32 and bf16, and the six-layer transformer (erase_triton.models). Median
step time from CUDA events: graphed steps one mode at a time, eager steps with the modes
interleaved on one model (`time_eager_modes`), with a paired estimate (the median over
rounds of sequential's time / each variant's in the same round); peak memory of the eager
step. An event round times one step, not a run: for a run's throughput add --wall-steps K (blocks of K
steps of one variant, by the wall clock; at w >= 1024 b16384 the two differ: docs/results.md).
--free-heads adds graphed erase with zero-cost heads (`FreeHead`): PyTorch heads / free heads
bounds what any head implementation can buy; each config gets two such rows: "free" sends a
constant gradient into the block, "free-replayed" the first step's real head gradient, so the block's
backward GEMMs multiply the same kind of data as with a real head (a constant toggles few bits and
can run faster on a power-limited GPU). --compiled-heads adds graphed erase with compiled PyTorch heads
(`CompiledTorchHead`, the strongest PyTorch head), --compile-blocks compiles every model's blocks
(`compile_blocks`). Erase runs with the Scheduler's stream
priorities (--priorities, default the library's "tail"), and each config adds one erase variant
with priorities off (or "rising", with --priorities off), graphed and eager, in the same run:
summary columns *_equal_prio / eager_equal_priority_vs_seq*. --relu-in-head on|both: MLP
blocks hand their last ReLU to the head (`MLPChain(relu_in_head=True)`, LocalHead(activation=
"relu")); "both" runs each MLP config both ways (column relu_in_head). --captures K: each
graphed row is the median over K separate captures (one capture's replays vary by ~±3%).
--beside OCC[:PPS][:FIELD=INT],...: the launch of the heads that run beside the next segment
(LaunchConfig(occupancy=OCC, programs_per_sm=PPS, FIELD=INT), e.g. 0.125:two_pass=1:block_n=16),
replacing occupancy="auto" and its size rule; --final (same form): the final head's. --early-update: each
config also gets graphed erase with early updates (Scheduler(optimizer=): each segment's SGD right after its
backward), PyTorch and fused heads (streams "early-update"; summary *_early). Several settings run each config once per setting
(columns beside, final). CSV with GPU metadata.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics

import torch

from erase_triton import LaunchConfig, Scheduler, compile_blocks
from erase_triton.bench import (metadata, mlp_workload, print_table, time_eager_modes, time_step, transformer_workload,
                                with_heads, write_csv)

MLP_CONFIGS = [(256, 1024), (512, 1024), (512, 4096), (1024, 4096), (1024, 16384), (2048, 16384)]
MODES = ["e2e", "sequential", "erase"]


class SideStreamScheduler(Scheduler):
    """A Scheduler whose whole step runs on a side stream: what erase pays for leaving the
    caller's (default) stream, apart from forking."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._side = torch.cuda.Stream() if torch.cuda.is_available() else None

    @contextlib.contextmanager
    def step(self):
        side = self._side
        if side is None:  # no CUDA: nothing to switch
            with super().step():
                yield self
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), super().step():
            yield self
        torch.cuda.current_stream().wait_stream(side)


def _group_tiles(model, heads, group_tiles=None):
    """fused with group_tiles: claimed groups of k row tiles (LaunchConfig.group_tiles)."""
    if heads == "fused" and group_tiles:
        for hd in model.heads:
            hd.configure(group_tiles=group_tiles)
    return model


def _config(spec):
    """"OCC[:PPS][:FIELD=INT]..." -> LaunchConfig(occupancy=OCC or None for 1, programs_per_sm=PPS, FIELD=INT),
    e.g. "0.125:two_pass=1:block_n=16" (two_pass takes 0 or 1)."""
    occ, *rest = spec.split(":")
    kw = {}
    for part in rest:
        key, eq, val = part.partition("=")
        if not eq:
            key, val = "programs_per_sm", part
        kw[key] = bool(int(val)) if key == "two_pass" else int(val)
    return LaunchConfig(occupancy=None if float(occ) == 1.0 else float(occ), **kw)


def _launch_configs(model, beside, final):
    """beside, final: "OCC[:PPS]" (or ""): the config of the heads that run beside the next
    segment, and the final head's."""
    if beside:
        for hd in model.heads:
            hd.beside_config = _config(beside)
    if final:
        model.heads[-1].config = _config(final)
    return model


def mlp_case(width, batch, dtype, heads, occupancy="auto", group_tiles=None, relu_in_head=False, beside="", final=""):
    model, inputs = _build(mlp_workload, heads, width, batch, dtype, occupancy=occupancy, relu_in_head=relu_in_head)
    return _launch_configs(_group_tiles(model, heads, group_tiles), beside, final), inputs


def transformer_case(width, batch, seq, heads, occupancy="auto", beside=""):
    model, inputs = _build(transformer_workload, heads, width, batch, seq, occupancy=occupancy)
    return _launch_configs(model, beside, ""), inputs


PRIORITIES = None  # the erase ring's Scheduler(priorities=...): set by main (--priorities, else the library's)
CAPTURES = 1  # graphed rows: the median over this many captures (--captures)


def measure(model, inputs, mode, graphed, streams=None, priorities=None, early_update=False):
    runs = [time_step(model, inputs, mode, graphed, streams=streams, priorities=priorities or PRIORITIES,
                      early_update=early_update)
            for _ in range(CAPTURES if graphed else 1)]
    return statistics.median(r["ms"] for r in runs), runs[0].get("peak_mb", float("nan"))


def other_priorities() -> str:
    """The streams label of the graphed erase row run with the other priority setting."""
    return "equal-priority" if PRIORITIES != "off" else "rising-priority"


def other_setting() -> str:
    return "off" if PRIORITIES != "off" else "rising"


def _sched(mode, **kw):
    return Scheduler(mode, priorities=PRIORITIES, **kw)


BOUNDS = ("free", "free-replayed")  # heads that only bound what a head can buy
GRAPHED_ONLY = BOUNDS + ("torch-compile",)  # heads timed in graphed erase alone
COMPILE_BLOCKS = False  # --compile-blocks


def _build(workload, heads, *args, **kw):
    """with_heads(...), the blocks compiled with --compile-blocks. Dynamo's caches are reset first
    when anything is compiled: the compiled-head graphs are shared across models (recompile_limit)."""
    if COMPILE_BLOCKS or heads == "torch-compile":
        torch._dynamo.reset()
    model, inputs = with_heads(workload, heads, *args, **kw)
    if COMPILE_BLOCKS:
        compile_blocks(model)
    return model, inputs


def run_grid(cases, rows, ring_sizes=(2,), save=None, execs=(False, True), iters=40, bounds=(), early=False,
             wall_steps=0):
    for desc, build in cases:
        for heads in ("torch", "fused") + tuple(bounds):
            if heads in GRAPHED_ONLY:  # graphed erase only: bounds and baselines for graph_fused_vs_torch_heads
                if True in execs:
                    model, inputs = build(heads)
                    ms, peak = measure(model, inputs, "erase", True)
                    row = dict(desc, heads=heads, exec="graph", mode="erase", streams="auto", ms=ms, peak_mb=peak)
                    rows.append(row)
                    print(row, flush=True)
                    del model, inputs
                continue
            if False in execs:  # eager: the modes interleaved on one model (host drift hits all alike)
                model, inputs = build(heads)
                variants = {(m, "auto"): _sched(m) for m in MODES}
                if heads == "fused":  # what adaptive forking buys, and what a non-default stream costs
                    variants[("erase", "always-fork")] = _sched("erase", adaptive=False)
                    variants[("erase", other_priorities())] = Scheduler("erase", priorities=other_setting())
                    variants[("sequential", "side-stream")] = SideStreamScheduler("sequential")
                    variants[("sequential", "again")] = Scheduler("sequential")  # A/A: the noise floor
                per_round, per_wall = {}, {}
                res = time_eager_modes(model, inputs, variants, iters=iters, rounds=per_round,
                                       wall_steps=wall_steps, wall=per_wall)
                seq = per_round[("sequential", "auto")]
                for (mode, streams), (ms, peak, host_ms) in res.items():
                    # paired: the median over rounds of sequential's time / this variant's, same round
                    paired = statistics.median(a / b for a, b in zip(seq, per_round[(mode, streams)]))
                    row = dict(desc, heads=heads, exec="eager", mode=mode, streams=streams, ms=ms, peak_mb=peak,
                               host_ms=host_ms, forks=variants[(mode, streams)].last_forks,  # in the last step
                               paired_seq_over_this=paired)
                    if per_wall:  # wall clock over blocks of steps: a run's throughput, paired the same way
                        w = per_wall[(mode, streams)]
                        row.update(wall_ms=statistics.median(w), wall_paired_seq_over_this=statistics.median(
                            a / b for a, b in zip(per_wall[("sequential", "auto")], w)))
                    rows.append(row)
                    print(row, flush=True)
                del model, inputs
            if True not in execs:
                continue
            for mode in MODES:
                model, inputs = build(heads)
                ms, peak = measure(model, inputs, mode, True)
                row = dict(desc, heads=heads, exec="graph", mode=mode, streams="auto", ms=ms, peak_mb=peak)
                rows.append(row)
                print(row, flush=True)
                del model, inputs
            for k in list(ring_sizes) + [other_priorities()] + (["early-update"] if early else []):
                model, inputs = build(heads)
                if k == "early-update":  # the default ring, the scheduler stepping the SGD early
                    ms, peak = measure(model, inputs, "erase", True, early_update=True)
                elif isinstance(k, str):  # the default ring with the other priority setting
                    ms, peak = measure(model, inputs, "erase", True, priorities=other_setting())
                else:
                    ms, peak = measure(model, inputs, "erase", True, streams=k)
                row = dict(desc, heads=heads, exec="graph", mode="erase", streams=k, ms=ms, peak_mb=peak)
                rows.append(row)
                print(row, flush=True)
        torch.cuda.empty_cache()
        if save:
            save(rows)  # partial results survive a timeout


_PAIRED = ((("erase", "auto"), "erase"), (("sequential", "again"), "again"),
           (("erase", "equal-priority"), "equal_priority"), (("erase", "rising-priority"), "rising_priority"))
_WALL = ((("erase", "auto"), "erase"), (("erase", "always-fork"), "always_fork"), (("sequential", "again"), "again"))


def summarize(rows):
    """Speedups per config: erase vs sequential, erase vs e2e, fused vs torch heads."""
    out = []
    key = lambda r: (r["model"], r["width"], r["batch"], r["dtype"], r.get("relu_in_head", ""),  # noqa: E731
                     r.get("beside", ""), r.get("final", ""), r.get("compile_blocks", ""))
    groups = {}
    for r in rows:
        if r["streams"] == "auto":
            groups.setdefault(key(r), {})[(r["heads"], r["exec"], r["mode"])] = r["ms"]
    for k, g in groups.items():
        s = dict(model=k[0], width=k[1], batch=k[2], dtype=k[3], relu_in_head=k[4], beside=k[5], final=k[6],
                 compile_blocks=k[7])
        for ex in ("graph", "eager"):
            f = lambda h, m: g.get((h, ex, m), float("nan"))  # noqa: E731
            s[f"{ex}_erase_fused_ms"] = f("fused", "erase")
            s[f"{ex}_erase_vs_seq"] = f("fused", "sequential") / f("fused", "erase")
            s[f"{ex}_erase_vs_e2e"] = f("torch", "e2e") / f("fused", "erase")
            s[f"{ex}_fused_vs_torch_heads"] = f("torch", "erase") / f("fused", "erase")
        # the other priority setting (graphed erase): its step time and fused / PyTorch heads
        other_rows = [r for r in rows if key(r) == k and r["exec"] == "graph"
                      and r["streams"] in ("equal-priority", "rising-priority")]
        if other_rows:
            other = {r["heads"]: r["ms"] for r in other_rows}
            tag = other_rows[0]["streams"].split("-")[0]
            s[f"graph_erase_fused_ms_{tag}_prio"] = other.get("fused", float("nan"))
            s[f"graph_fused_vs_torch_heads_{tag}_prio"] = other.get("torch", float("nan")) / other.get("fused", float("nan"))
        early = {r["heads"]: r["ms"] for r in rows if key(r) == k and r["exec"] == "graph"
                 and r["streams"] == "early-update"}
        if early:  # early updates (Scheduler(optimizer=)): erase's step, and against e2e and PyTorch heads
            nan = float("nan")
            s["graph_erase_fused_ms_early"] = early.get("fused", nan)
            s["graph_early_vs_erase"] = g.get(("fused", "graph", "erase"), nan) / early.get("fused", nan)
            s["graph_early_vs_e2e"] = g.get(("torch", "graph", "e2e"), nan) / early.get("fused", nan)
            s["graph_fused_vs_torch_heads_early"] = early.get("torch", nan) / early.get("fused", nan)
        # the most any head can buy: free (zero-cost) heads against PyTorch heads; "free" sends a
        # constant into the block, "free-replayed" a real head's gradient (the same data as a real head)
        s["graph_free_vs_torch_heads"] = g.get(("torch", "graph", "erase"), float("nan")) / \
            g.get(("free", "graph", "erase"), float("nan"))
        if ("free-replayed", "graph", "erase") in g:
            s["graph_free_replayed_vs_torch_heads"] = g[("torch", "graph", "erase")] / g[("free-replayed", "graph", "erase")]
        if ("torch-compile", "graph", "erase") in g:  # the strongest PyTorch head: compiled
            s["graph_fused_vs_compiled_heads"] = g[("torch-compile", "graph", "erase")] / g[("fused", "graph", "erase")]
            s["graph_compiled_vs_torch_heads"] = g[("torch", "graph", "erase")] / g[("torch-compile", "graph", "erase")]
        seq = g.get(("fused", "eager", "sequential"), float("nan"))
        for variant in ("always-fork", "side-stream", "again", "equal-priority", "rising-priority"):
            ms = [r["ms"] for r in rows if key(r) == k and r["streams"] == variant]
            if ms:
                s[f"eager_{variant.replace('-', '_')}_vs_seq"] = seq / ms[0]
        # the median over rounds of sequential / this variant, both in the same round: by CUDA events
        # (paired), and by the host clock over blocks of steps (wall, --wall-steps)
        for col, suffix, names in (("paired_seq_over_this", "paired", _PAIRED), ("wall_paired_seq_over_this", "wall", _WALL)):
            for (mode, streams), name in names:
                p = [r[col] for r in rows if key(r) == k and r["exec"] == "eager" and r["heads"] == "fused"
                     and (r["mode"], r["streams"]) == (mode, streams) and r.get(col) not in (None, "")]
                if p:
                    s[f"eager_{name}_vs_seq_{suffix}"] = float(p[0])
        host = {r["mode"]: r["host_ms"] for r in rows
                if key(r) == k and r["exec"] == "eager" and r["heads"] == "fused" and r["streams"] == "auto"}
        if host:
            s["eager_host_ms_seq"], s["eager_host_ms_erase"] = host.get("sequential"), host.get("erase")
        out.append(s)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="all", choices=["mlp", "transformer", "all"])
    ap.add_argument("--out", default="benchmarks/results/schedule.csv")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-width", type=int, default=None, help="only configs up to this width")
    ap.add_argument("--exec", default="both", choices=["both", "eager", "graph"], help="eager steps, graphed, or both")
    ap.add_argument("--occupancy", default="auto", help="the fused heads' occupancy: auto (default) or a fraction")
    ap.add_argument("--iters", type=int, default=40, help="eager rounds (every variant once a round)")
    ap.add_argument("--wall-steps", type=int, default=0,
                    help="eager: also --iters rounds of K consecutive steps a variant between device syncs, by the "
                         "host clock (a run's throughput; CUDA events time the GPU's share of a step); columns "
                         "wall_ms, wall_paired_seq_over_this, summary eager_*_vs_seq_wall")
    ap.add_argument("--free-heads", action="store_true",
                    help="also time graphed erase with zero-cost heads (the bound on fused vs PyTorch heads): "
                         "a constant gradient (free) and the first step's real one (free-replayed)")
    ap.add_argument("--compiled-heads", action="store_true",
                    help="also time graphed erase with compiled PyTorch heads (CompiledTorchHead: the head's logits "
                         "and loss under torch.compile); summary columns graph_fused_vs_compiled_heads, "
                         "graph_compiled_vs_torch_heads")
    ap.add_argument("--compile-blocks", action="store_true",
                    help="torch.compile every model's blocks between the heads (compile_blocks); column compile_blocks")
    ap.add_argument("--group-tiles", type=int, default=None,
                    help="MLP fused heads take claimed groups of K row tiles (fewer programs, fewer end-of-kernel atomics)")
    ap.add_argument("--priorities", default=None, choices=["rising", "tail", "off"],
                    help="Scheduler(priorities=...) of the erase ring (default: the library's); each config also "
                         "gets one graphed erase row with priorities off (or rising, when this is off)")
    ap.add_argument("--min-width", type=int, default=None, help="only MLP configs from this width")
    ap.add_argument("--relu-in-head", default="off", choices=["off", "on", "both"],
                    help="MLP blocks hand their last ReLU to the head (LocalHead(activation='relu')); both: each "
                         "config both ways")
    ap.add_argument("--captures", type=int, default=1, help="graphed rows: the median over K captures")
    ap.add_argument("--early-update", action="store_true",
                    help="also graphed erase with early updates (Scheduler(optimizer=)); summary columns *_early")
    ap.add_argument("--final", default="", help="OCC[:PPS][:FIELD=INT],...: LaunchConfig of the MLP's final head; "
                    "each a row")
    ap.add_argument("--beside", default="", help="OCC[:PPS][:FIELD=INT],...: LaunchConfig(occupancy=OCC, "
                    "programs_per_sm=PPS, FIELD=INT) of the heads beside the next segment (default: the library's); "
                    "each setting a row")
    args = ap.parse_args()
    if args.wall_steps < 0:
        ap.error(f"--wall-steps must be >= 0 (0: no wall-clock blocks), got {args.wall_steps}")
    global PRIORITIES, CAPTURES, COMPILE_BLOCKS
    PRIORITIES = args.priorities or Scheduler().priorities
    COMPILE_BLOCKS = args.compile_blocks
    CAPTURES = args.captures
    occ = args.occupancy if args.occupancy == "auto" else float(args.occupancy)
    meta = metadata()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    cases = []
    if args.model in ("mlp", "all"):
        cfgs = MLP_CONFIGS[:2] if args.quick else MLP_CONFIGS
        cfgs = [c for c in cfgs if (args.max_width is None or c[0] <= args.max_width)
                and (args.min_width is None or c[0] >= args.min_width)]
        relu = {"off": (False,), "on": (True,), "both": (False, True)}[args.relu_in_head]
        launches = [(bs, fi) for bs in args.beside.split(",") for fi in args.final.split(",")]
        for dname, dtype in (("tf32", torch.float32), ("bf16", torch.bfloat16)):
            for w, b in cfgs:
                for r in relu:
                    for bs, fi in launches:
                        cases.append((dict(model="mlp", width=w, batch=b, dtype=dname, occupancy=args.occupancy,
                                           group_tiles=args.group_tiles or "", priorities=PRIORITIES,
                                           relu_in_head=int(r), beside=bs, final=fi, captures=args.captures,
                                           compile_blocks=int(args.compile_blocks)),
                                      lambda heads, w=w, b=b, dtype=dtype, r=r, bs=bs, fi=fi: mlp_case(
                                          w, b, dtype, heads, occ, args.group_tiles, r, bs, fi)))
    if args.model in ("transformer", "all"):
        tf = [(256, 32, 128)] if args.quick else [(256, 32, 128), (512, 32, 256), (1024, 32, 256)]
        for w, b, s in [c for c in tf if args.max_width is None or c[0] <= args.max_width]:
            for bs in args.beside.split(","):
                cases.append((dict(model="transformer", width=w, batch=b, seq=s, dtype="bf16", occupancy=args.occupancy,
                                   priorities=PRIORITIES, beside=bs, captures=args.captures,
                                   compile_blocks=int(args.compile_blocks)),
                              lambda heads, w=w, b=b, s=s, bs=bs: transformer_case(w, b, s, heads, occ, bs)))
    execs = {"both": (False, True), "eager": (False,), "graph": (True,)}[args.exec]
    run_grid(cases, rows, save=lambda r: write_csv(args.out, r, meta), execs=execs, iters=args.iters,
             wall_steps=args.wall_steps,
             bounds=(("free", "free-replayed") if args.free_heads else ())
             + (("torch-compile",) if args.compiled_heads else ()), early=args.early_update)
    write_csv(args.out, rows, meta)
    summ = summarize(rows)
    write_csv(os.path.splitext(args.out)[0] + "_summary.csv", summ, meta)
    print_table(summ, ["model", "width", "batch", "dtype", "relu_in_head", "beside", "final", "compile_blocks",
                       "graph_erase_fused_ms", "graph_erase_vs_seq",
                       "graph_erase_vs_e2e", "graph_fused_vs_torch_heads", "graph_free_vs_torch_heads",
                       "graph_free_replayed_vs_torch_heads",
                       "graph_fused_vs_compiled_heads", "graph_compiled_vs_torch_heads",
                       "graph_erase_fused_ms_early", "graph_early_vs_erase", "graph_early_vs_e2e",
                       "graph_fused_vs_torch_heads_early", "graph_erase_fused_ms_equal_prio",
                       "graph_fused_vs_torch_heads_equal_prio", "eager_erase_vs_seq", "eager_erase_vs_seq_paired",
                       "eager_erase_vs_seq_wall", "eager_always_fork_vs_seq_wall", "eager_again_vs_seq_wall",
                       "eager_again_vs_seq_paired", "eager_equal_priority_vs_seq_paired", "eager_always_fork_vs_seq",
                       "eager_side_stream_vs_seq", "eager_again_vs_seq", "eager_host_ms_seq",
                       "eager_host_ms_erase"])


if __name__ == "__main__":
    main()
