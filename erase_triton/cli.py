"""`erase-triton` command: train | bench | sweep | trace | plot.

Every user mistake ends in one `error: ...` line and exit status 2, before any work starts.
Under `torchrun --nproc_per_node N`, `train` runs data-parallel (docs/api.md#many-gpus).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import torch


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _fail(msg: str):
    print(f"erase-triton: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _writable_file(path: str | None, what: str, image: bool = False):
    """Fail now, not after training, if `path` cannot be written (as a picture, with `image`)."""
    if not path:
        return
    if os.path.isdir(path):
        _fail(f"{what} {path!r} is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        _fail(f"{what} {path!r}: folder {folder!r} does not exist")
    if image:
        from matplotlib.figure import Figure
        kinds = Figure().canvas.get_supported_filetypes()
        ext = os.path.splitext(path)[1].lstrip(".").lower()
        if ext not in kinds:
            _fail(f"{what} {path!r}: the name must end in a picture format ({', '.join('.' + k for k in sorted(kinds))})")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        _fail(f"{what} {path!r} is not writable")


def _out_dir(path: str) -> str:
    if os.path.exists(path) and not os.path.isdir(path):
        _fail(f"--out {path!r} is a file; give a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        _fail(f"--out {path!r}: {e.strerror}")
    if not os.access(path, os.W_OK):
        _fail(f"--out {path!r} is not writable")
    return path


def _device(name: str | None) -> str:
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda given but no CUDA device is visible")
    return name


def _cpu_notice(cmd: str):
    if not torch.cuda.is_available():
        print(f"note: no CUDA device: `{cmd}` runs one small size a model on the CPU to show the pipeline; "
              "its times say nothing about GPU speed (the committed H200 results do: benchmarks/results/)",
              file=sys.stderr)


def cmd_train(a):
    from .distributed import launch_from_env
    from .train import train_ctr, train_transformer, write_json

    if a.model != "ctr":  # CTR-only options are not silently dropped
        given = [f"--{k}" for k in ("data", "embedding") if getattr(a, k) is not None]
        if given:
            _fail(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to --model ctr only")
    a.data, a.embedding = a.data or "movielens", a.embedding or "table"

    dist = launch_from_env(a.device)  # torchrun: process group up, this rank's device chosen
    dev = dist.device if dist is not None else _device(a.device)
    if a.graph and not str(dev).startswith("cuda"):
        _fail("--graph needs a CUDA device (CUDA graphs)")
    if a.backend == "triton" and not str(dev).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        _fail("--backend triton needs a CUDA device (or TRITON_INTERPRET=1 for the slow interpreter on CPU)")
    rank0 = dist is None or dist.rank == 0
    if a.no_plot:
        a.plot = None
    elif a.plot is None:
        a.plot = os.path.join("runs", f"train_{a.model}_{a.mode}.png")
        if rank0:
            os.makedirs("runs", exist_ok=True)
    if rank0:
        _writable_file(a.json, "--json")
        _writable_file(a.plot, "--plot", image=True)
    kw = dict(mode=a.mode, steps=a.steps, batch_size=a.batch_size, device=dev, graph=a.graph, seed=a.seed,
              backend=a.backend, head_every=a.head_every, distributed=dist is not None, progress=rank0)
    ok = False
    try:
        if a.model == "ctr":
            r = train_ctr(data=a.data, embedding=a.embedding, **kw)
        else:
            r = train_transformer(**kw)
        ok = True
    except (ImportError, OSError, ValueError) as e:  # missing or malformed data, a batch larger than the data
        _fail(f"{type(e).__name__}: {e}")
    finally:
        if dist is not None:
            dist.close(barrier=ok)
    if not rank0:
        return
    world = f" ranks={r['world_size']}" if r.get("world_size", 1) > 1 else ""
    if a.model == "ctr":
        print(f"ctr/{r['data']} mode={r['mode']} head_every={r['head_every']} steps={r['steps']} "
              f"batch={r['batch_size']}{world} device={r['device']}"
              f"{' graph' if r['graph'] else ''}\n  test NE {r['ne']:.4f}   AUC {r['auc']:.4f}   log loss "
              f"{r['logloss']:.4f}\n  {r['examples_per_s']:,.0f} examples/s   peak memory {r['peak_memory_mb']:.0f} MB")
    else:
        print(f"transformer/{r['data']} mode={r['mode']} head_every={r['head_every']} steps={r['steps']} "
              f"batch={r['batch_size']}{world} device={r['device']}"
              f"\n  validation perplexity {r['perplexity']:.3f}\n  {r['examples_per_s']:,.0f} sequences/s "
              f"({r['tokens_per_s']:,.0f} tokens/s)   peak memory {r['peak_memory_mb']:.0f} MB")
    write_json(r, a.json)
    if a.json:
        print(f"  wrote {a.json}")
    if a.plot:
        from .bench.plots import plot_training

        plot_training(r, a.plot)
        print(f"  loss curve: {a.plot}")


def cmd_bench(a):
    from .bench import bench
    from .bench.plots import plot_bench

    _cpu_notice("erase-triton bench")
    models = ("ctr", "transformer") if a.model == "all" else (a.model,)
    rows = bench(_out_dir(a.out), quick=a.quick, compile_baseline=not a.no_compile, models=models, eager=a.eager,
                 embedding=a.embedding)
    plot_bench([{k: str(v) for k, v in r.items()} for r in rows], os.path.join(a.out, "bench.png"))
    print(f"wrote {a.out}/bench.csv and bench.png")


def cmd_sweep(a):
    from .bench import sweep
    from .bench.plots import plot_sweep

    _cpu_notice("erase-triton sweep")
    rows = sweep(_out_dir(a.out), quick=a.quick)
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
    if not torch.cuda.is_available():
        _fail("trace needs a CUDA device (kernel timelines come from CUPTI); the committed H200 timelines are "
              "under benchmarks/plots/")
    from .bench import trace

    execs = {"both": ("graph", "eager"), "graph": ("graph",), "eager": ("eager",)}[a.exec]
    for s in trace(_out_dir(a.out), steps=a.steps, only=a.only, execs=execs):
        print(json.dumps(s))
    print(f"wrote traces and timelines under {a.out}")


def cmd_plot(a):
    from .bench.plots import plot_file

    for p in a.results:
        if not os.path.isfile(p):
            _fail(f"{p!r} is not a file")
    if a.out:
        _out_dir(a.out)
    drawn = 0
    for p in a.results:
        try:
            print(plot_file(p, a.out))
            drawn += 1
        except KeyError as e:  # a known study's columns, one missing
            print(f"skipped {p}: no plot for it (missing column {e})", file=sys.stderr)
        except (ValueError, UnicodeDecodeError, csv.Error) as e:  # not a result CSV of a known study
            print(f"skipped {p}: {e}", file=sys.stderr)
    if not drawn:
        _fail("no plot drawn: none of the files is a result CSV of a known study")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="erase-triton", description="Early backpropagation (ERASE) with fused Triton heads")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a CTR model or the byte-level transformer (torchrun: data-parallel)")
    t.add_argument("--model", choices=["ctr", "transformer"], default="ctr")
    t.add_argument("--mode", choices=["e2e", "sequential", "erase"], default="erase")
    t.add_argument("--steps", type=_positive_int, default=None, help="default: 400 (ctr, CPU) / 300 (transformer, CPU)")
    t.add_argument("--batch-size", type=_positive_int, default=None, help="per rank under torchrun")
    t.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if visible")
    t.add_argument("--graph", action="store_true", help="capture each step in a CUDA graph")
    t.add_argument("--data", choices=["movielens", "synthetic"], default=None, help="ctr data (default: movielens)")
    t.add_argument("--embedding", choices=["table", "fused_sgd"], default=None,
                   help="ctr tables: nn.Embedding trained by Adam (table, the default), or SGD fused into the backward")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--head-every", type=int, default=1, choices=[1, 2, 3, 6],
                   help="a local head after every K of the transformer's 6 layers or the CTR model's 6 "
                        "subarchitectures (fewer segments, a smaller quality gap)")
    t.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto",
                   help="head backend: auto = Triton on CUDA, PyTorch on CPU")
    t.add_argument("--json", default=None, help="write the summary here")
    t.add_argument("--plot", default=None, help="save the loss curve here (PNG; default runs/train_MODEL_MODE.png)")
    t.add_argument("--no-plot", action="store_true", help="no loss-curve picture")
    t.set_defaults(fn=cmd_train)
    for name, fn, helptext in [("bench", cmd_bench, "speedup curves: erase vs sequential vs e2e vs torch.compile (host-issued and graphed)"),
                               ("sweep", cmd_sweep, "step time against the heads' occupancy and ring size")]:
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--out", default="runs", help=f"folder for {name}.csv, its .meta.json and {name}.png (default: runs)")
        p.add_argument("--quick", action="store_true",
                       help="two sizes a model, not all" if name == "bench" else "one small size a model, every occupancy")
        if name == "bench":
            p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
            p.add_argument("--model", choices=["ctr", "transformer", "all"], default="all")
            p.add_argument("--eager", action="store_true", help="also time eager steps")
            p.add_argument("--embedding", choices=["fused_sgd", "table"], default="fused_sgd",
                           help="CTR proxy tables: SGD fused into backward (default) or nn.Embedding with dense grads")
        p.set_defaults(fn=fn)
    tr = sub.add_parser("trace", help="profiler traces + stream timelines of erase steps (CUDA)")
    tr.add_argument("--out", default="runs", help="folder for the Chrome traces, timelines and trace_summary.csv")
    tr.add_argument("--steps", type=_positive_int, default=3, help="steps profiled a config")
    tr.add_argument("--only", default=None, help="only the configs whose name contains this")
    tr.add_argument("--exec", default="both", choices=["both", "graph", "eager"], help="graph replays, eager steps or both")
    tr.set_defaults(fn=cmd_trace)
    pl = sub.add_parser("plot", help="plot result CSVs (e.g. benchmarks/results/*.csv)")
    pl.add_argument("results", nargs="+")
    pl.add_argument("--out", default=None, help="folder for the PNGs (default: beside each CSV)")
    pl.set_defaults(fn=cmd_plot)
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    a.fn(a)


if __name__ == "__main__":
    main()
