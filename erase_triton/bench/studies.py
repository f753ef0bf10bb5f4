"""The studies behind `erase-triton bench | sweep`: speedup curves (e2e / sequential / erase
and torch.compile baselines) and the occupancy sweep. Each runs every variant in one process
on one GPU and writes a CSV with its metadata; on a CPU they run one small size a model
(the numbers then say nothing about speed)."""
from __future__ import annotations

import os

import torch

from .io import write_csv
from ..progress import progress, say
from .timing import tf32_metadata, time_compiled_e2e, time_step
from .workloads import COMPILE_AT, CTR_EMBEDDING, bench_cases, ctr_workload, transformer_workload

__all__ = ["OCCUPANCIES", "bench", "compile_rows", "sweep"]

OCCUPANCIES = [1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0]


def compile_rows(name: str, desc: dict, build, log=say, modes=("e2e", "sequential", "erase"),
                 early_update: bool = False) -> list[dict]:
    """torch.compile rows of one size. e2e: the plain e2e step compiled whole, loss included
    (`time_compiled_e2e`), with the host issuing every kernel (exec "compile") and captured in
    one CUDA graph ("compile+graph": the strongest e2e baseline). sequential / erase: the blocks
    between the heads compiled (`compile_blocks`), the fused heads as they are, the whole step in
    one CUDA graph ("compile+graph"). early_update: also erase with early updates (the scheduler
    steps each segment's SGD after its backward; column early_update=1). A row that fails to
    compile or capture keeps its error, not a lost study."""
    runs = []
    if "e2e" in modes:
        runs += [("compile", "e2e", False, lambda m, x: time_compiled_e2e(m, x)),
                 ("compile+graph", "e2e", False, lambda m, x: time_compiled_e2e(m, x, graphed=True))]
    runs += [("compile+graph", mode, False, lambda m, x, mode=mode: time_step(m, x, mode, True, compiled=True))
             for mode in ("sequential", "erase") if mode in modes]
    if early_update:
        runs.append(("compile+graph", "erase", True,
                     lambda m, x: time_step(m, x, "erase", True, compiled=True, early_update=True)))
    rows = []
    for exec_, mode, early, timed in runs:
        model, inputs = build()
        tag = dict(early_update=1) if early else {}
        try:
            r = dict(model=name, **desc, exec=exec_, mode=mode, **tag, **timed(model, inputs))
        except Exception as e:  # noqa: BLE001 -- see the docstring
            r = dict(model=name, **desc, exec=exec_, mode=mode, **tag, error=repr(e)[:200])
        rows.append(r)
        log(r)
        del model, inputs
        torch._dynamo.reset()
    return rows


def bench(out_dir: str, quick: bool = False, compile_baseline: bool = True, models=("ctr", "transformer"),
          eager: bool = False, embedding: str = CTR_EMBEDDING, log=say) -> list[dict]:
    """Speedup curves: erase (fused heads) vs sequential vs e2e vs torch.compile(e2e).

    Graphed steps (the regime the scheduler is for); `eager` adds eager steps. fp32
    matmuls run in TF32, as a CTR user on Hopper runs them (recorded in the CSV metadata).
    embedding: the CTR proxy's tables ("fused_sgd" or "table", see `ctr_workload`).
    """
    cuda = torch.cuda.is_available()
    meta = tf32_metadata()
    rows = []
    for name, desc, build in progress(bench_cases(quick, models, embedding), desc="bench", unit="size"):
        for graphed in ([True] + ([False] if eager else []) if cuda else [False]):
            for mode in ("e2e", "sequential", "erase"):
                model, inputs = build()
                r = dict(model=name, **desc, exec="graph" if graphed else "eager", mode=mode, **time_step(model, inputs, mode, graphed))
                rows.append(r)
                log(r)
        if compile_baseline and cuda and (name, desc["width"], desc["batch"]) in COMPILE_AT:
            rows += compile_rows(name, desc, build, log)
        if cuda:
            torch.cuda.empty_cache()
        write_csv(os.path.join(out_dir, "bench.csv"), rows, meta)
    return rows


# ------------------------------------------------------------------------------- sweep
def sweep(out_dir: str, quick: bool = False, log=say) -> list[dict]:
    """Step time against the heads' SM fraction (and ring size), per model and size.
    fp32 matmuls in TF32, like `bench`."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    meta = tf32_metadata()
    occs = OCCUPANCIES
    if cuda:
        cases = [("ctr", dict(width=256, batch=8192), lambda o: ctr_workload(256, 8192, occupancy=o)),
                 ("ctr", dict(width=1024, batch=16384), lambda o: ctr_workload(1024, 16384, occupancy=o)),
                 ("transformer", dict(width=256, batch=32, seq=128), lambda o: transformer_workload(256, 32, 128, occupancy=o)),
                 ("transformer", dict(width=1024, batch=32, seq=256), lambda o: transformer_workload(1024, 32, 256, occupancy=o))]
        if quick:  # one small size per model, every occupancy
            cases = [("ctr", dict(width=512, batch=4096), lambda o: ctr_workload(512, 4096, occupancy=o)), cases[2]]
    else:
        cases = [("ctr", dict(width=64, batch=256), lambda o: ctr_workload(64, 256, rows=1000, occupancy=o, device=dev))]
    rows = []
    for name, desc, build in progress(cases, desc="sweep", unit="size"):
        for occ in occs:
            for graphed, streams in ([(True, None), (True, 2), (False, None)] if cuda else [(False, None)]):
                model, inputs = build(occ)
                r = dict(model=name, **desc, occupancy=occ, streams=streams or "per-segment",
                         exec="graph" if graphed else "eager", **time_step(model, inputs, "erase", graphed, streams))
                rows.append(r)
                log(r)
        write_csv(os.path.join(out_dir, "sweep.csv"), rows, meta)
    return rows
