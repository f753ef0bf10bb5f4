"""Early updates (Scheduler(optimizer=)) against the optimizer step after the step, graphed erase.

For each size and optimizer (SGD; Adam with capturable=True, foreach; Adam with fused=True, one
kernel a step: the strongest Adam a user would pick) it times graphed erase with the update at the
end and with early updates, and graphed e2e (the update at the end), alternating them over
--captures rounds (a fresh model and capture each), and the optimizer's step alone, issued eagerly
(all parameters, grads populated; host-bound for the foreach Adam). With --compiled, every step
has its blocks compiled first (`compile_blocks`; e2e too, so the three rows compare like with like).

    python benchmarks/bench_early_update.py --out benchmarks/results/early_update.csv [--captures 3] [--compiled]

CUDA only.
"""
import argparse
import statistics

import torch

from erase_triton import Scheduler
from erase_triton.bench import median_ms, mlp_workload, print_table, tf32_metadata, time_step, transformer_workload, write_csv

SIZES = {
    "mlp:512:1024:tf32": lambda: mlp_workload(512, 1024, torch.float32),
    "mlp:512:4096:tf32": lambda: mlp_workload(512, 4096, torch.float32),
    "mlp:256:1024:bf16": lambda: mlp_workload(256, 1024, torch.bfloat16),
    "transformer:512:32:128": lambda: transformer_workload(512, 32, 128),
    "transformer:1024:32:256": lambda: transformer_workload(1024, 32, 256),
}
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4, capturable=True, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-4, fused=True, capturable=True),
}


def graphed_ms(build, make_opt, early: bool, mode: str = "erase", compiled: bool = False) -> float:
    model, inputs = build()
    return time_step(model, inputs, mode, True, early_update=early, optimizer=make_opt, compiled=compiled)["ms"]


def update_alone_ms(build, make_opt) -> float:
    model, inputs = build()
    opt = make_opt(model.parameters())
    with Scheduler("sequential").step():
        model(*inputs)  # populates every .grad
    return median_ms(opt.step, 30, 5)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/early_update.csv")
    ap.add_argument("--captures", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None, choices=sorted(SIZES))
    ap.add_argument("--optimizers", nargs="*", default=sorted(OPTIMIZERS), choices=sorted(OPTIMIZERS))
    ap.add_argument("--compiled", action="store_true", help="compile the blocks between the heads (column compiled=1)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_early_update.py needs CUDA (graphed steps, CUDA events)")
    meta = tf32_metadata()
    rows = []
    for size in args.only or SIZES:
        build = SIZES[size]
        for oname in args.optimizers:
            make = OPTIMIZERS[oname]
            end, early, e2e = [], [], []
            try:
                for _ in range(args.captures):  # alternate: drift hits all alike
                    end.append(graphed_ms(build, make, False, compiled=args.compiled))
                    early.append(graphed_ms(build, make, True, compiled=args.compiled))
                    e2e.append(graphed_ms(build, make, False, "e2e", compiled=args.compiled))
                r = dict(size=size, optimizer=oname, compiled=int(args.compiled), update_alone_ms=update_alone_ms(build, make),
                         e2e_ms=statistics.median(e2e), erase_ms=statistics.median(end),
                         erase_early_ms=statistics.median(early), erase_each=";".join(f"{m:.4f}" for m in end),
                         early_each=";".join(f"{m:.4f}" for m in early))
                r["early_vs_end"] = r["erase_ms"] / r["erase_early_ms"]
                r["saved_ms"] = r["erase_ms"] - r["erase_early_ms"]
                r["early_vs_e2e"] = r["e2e_ms"] / r["erase_early_ms"]
            except Exception as e:  # noqa: BLE001 -- a failing optimizer keeps a row with its error
                r = dict(size=size, optimizer=oname, compiled=int(args.compiled), error=repr(e)[:200])
            rows.append(r)
            print(r, flush=True)
            write_csv(args.out, rows, meta)
            torch.cuda.empty_cache()
    print_table(rows, ["size", "optimizer", "update_alone_ms", "e2e_ms", "erase_ms", "erase_early_ms", "early_vs_end",
                       "saved_ms", "early_vs_e2e", "error"])


if __name__ == "__main__":
    main()
