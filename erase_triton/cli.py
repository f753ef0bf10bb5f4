"""`erase-triton` command: train | bench | sweep | trace | plot."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _device(name: str | None) -> str:
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda given but no CUDA device is visible")
    return name


def cmd_train(a):
    from .train import train_ctr, train_transformer, write_json

    dev = _device(a.device)
    if a.graph and dev != "cuda":
        sys.exit("error: --graph needs --device cuda (CUDA graphs)")
    kw = dict(mode=a.mode, steps=a.steps, batch_size=a.batch_size, device=dev, graph=a.graph, seed=a.seed,
              backend=a.backend, head_every=a.head_every)
    if a.model == "ctr":
        r = train_ctr(data=a.data, embedding=a.embedding, **kw)
        print(f"ctr/{r['data']} mode={r['mode']} head_every={r['head_every']} steps={r['steps']} "
              f"batch={r['batch_size']} device={r['device']}"
              f"{' graph' if r['graph'] else ''}\n  test NE {r['ne']:.4f}   AUC {r['auc']:.4f}   log loss "
              f"{r['logloss']:.4f}\n  {r['examples_per_s']:,.0f} examples/s   peak memory {r['peak_memory_mb']:.0f} MB")
    else:
        r = train_transformer(**kw)
        print(f"transformer/{r['data']} mode={r['mode']} head_every={r['head_every']} steps={r['steps']} "
              f"batch={r['batch_size']} device={r['device']}"
              f"\n  validation perplexity {r['perplexity']:.3f}\n  {r['examples_per_s']:,.0f} sequences/s "
              f"({r['tokens_per_s']:,.0f} tokens/s)   peak memory {r['peak_memory_mb']:.0f} MB")
    write_json(r, a.json)
    if a.json:
        print(f"  wrote {a.json}")


def cmd_bench(a):
    from .plots import plot_bench
    from .study import bench

    models = ("ctr", "transformer") if a.model == "all" else (a.model,)
    rows = bench(a.out, quick=a.quick, compile_baseline=not a.no_compile, models=models, eager=a.eager,
                 embedding=a.embedding)
    plot_bench([{k: str(v) for k, v in r.items()} for r in rows], os.path.join(a.out, "bench.png"))
    print(f"wrote {a.out}/bench.csv and bench.png")


def cmd_sweep(a):
    from .plots import plot_sweep
    from .study import sweep

    rows = sweep(a.out, quick=a.quick)
    plot_sweep([{k: str(v) for k, v in r.items()} for r in rows], os.path.join(a.out, "sweep.png"))
    best = {}
    for r in rows:
        k = (r["model"], r.get("width"), r["exec"], r["streams"])
        if k not in best or r["ms"] < best[k]["ms"]:
            best[k] = r
    for k, r in best.items():
        print(f"best occupancy {r['occupancy']:.4g} for {k}: {r['ms']:.3f} ms")
    print(f"wrote {a.out}/sweep.csv and sweep.png")


def cmd_trace(a):
    from .study import trace

    execs = {"both": ("graph", "eager"), "graph": ("graph",), "eager": ("eager",)}[a.exec]
    for s in trace(a.out, steps=a.steps, only=a.only, execs=execs):
        print(json.dumps(s))
    print(f"wrote traces and timelines under {a.out}")


def cmd_plot(a):
    from .plots import plot_file

    drawn = 0
    for p in a.results:
        try:
            print(plot_file(p, a.out))
            drawn += 1
        except ValueError as e:  # e.g. a raw CSV whose summary is the plotted one
            print(f"skipped: {e}", file=sys.stderr)
    if not drawn:
        raise SystemExit("no plot drawn")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="erase-triton", description="Early backpropagation (ERASE) with fused Triton heads")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a CTR model or the byte-level transformer")
    t.add_argument("--model", choices=["ctr", "transformer"], default="ctr")
    t.add_argument("--mode", choices=["e2e", "sequential", "erase"], default="erase")
    t.add_argument("--steps", type=int, default=None, help="default: 400 (ctr, CPU) / 300 (transformer, CPU)")
    t.add_argument("--batch-size", type=int, default=None)
    t.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if visible")
    t.add_argument("--graph", action="store_true", help="capture each step in a CUDA graph")
    t.add_argument("--data", choices=["movielens", "synthetic"], default="movielens", help="ctr data")
    t.add_argument("--embedding", choices=["table", "fused_sgd"], default="table",
                   help="ctr tables: nn.Embedding trained by Adam, or SGD fused into the backward")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--head-every", type=int, default=1, choices=[1, 2, 3, 6],
                   help="a local head after every K of the transformer's 6 layers or the CTR model's 6 "
                        "subarchitectures (fewer segments, a smaller quality gap)")
    t.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto",
                   help="head backend: auto = Triton on CUDA, PyTorch on CPU")
    t.add_argument("--json", default=None, help="write the summary here")
    t.set_defaults(fn=cmd_train)
    for name, fn, helptext in [("bench", cmd_bench, "speedup curves: erase vs sequential vs e2e vs torch.compile (host-issued and graphed)"),
                               ("sweep", cmd_sweep, "step time against the heads' occupancy and ring size")]:
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--out", default="runs")
        p.add_argument("--quick", action="store_true")
        if name == "bench":
            p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
            p.add_argument("--model", choices=["ctr", "transformer", "all"], default="all")
            p.add_argument("--eager", action="store_true", help="also time eager steps")
            p.add_argument("--embedding", choices=["fused_sgd", "table"], default="fused_sgd",
                           help="CTR proxy tables: SGD fused into backward (default) or nn.Embedding with dense grads")
        p.set_defaults(fn=fn)
    tr = sub.add_parser("trace", help="profiler traces + stream timelines of erase steps (CUDA)")
    tr.add_argument("--out", default="runs")
    tr.add_argument("--steps", type=int, default=3)
    tr.add_argument("--only", default=None, help="only the configs whose name contains this")
    tr.add_argument("--exec", default="both", choices=["both", "graph", "eager"], help="graph replays, eager steps or both")
    tr.set_defaults(fn=cmd_trace)
    pl = sub.add_parser("plot", help="plot result CSVs (e.g. benchmarks/results/*.csv)")
    pl.add_argument("results", nargs="+")
    pl.add_argument("--out", default=None, help="folder for the PNGs (default: beside each CSV)")
    pl.set_defaults(fn=cmd_plot)
    a = ap.parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main()
