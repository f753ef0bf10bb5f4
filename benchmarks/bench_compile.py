"""The torch.compile rows of the speedup study alone, at the sizes `erase-triton bench` compiles
(erase_triton.bench.COMPILE_AT), or a few of them:

- e2e compiled whole, loss included, with the host issuing every kernel ("compile") and captured
  in one CUDA graph ("compile+graph": the strongest e2e baseline);
- sequential and erase with the blocks between the heads compiled (`compile_blocks`) and the
  whole step captured ("compile+graph");
- with --paired, the graphed e2e / sequential / erase rows with uncompiled blocks ("graph"), in
  the same run (ratios across runs carry the runs' drift);
- with --beside OCC,..., erase with compiled blocks and the side heads at other occupancies;
- with --head-every K[,K...], both models with a local head after every K-th of their six blocks
  (6/K segments), each K in turn (column head_every);
- with --vocab V [--vocab-path PATH], the transformer with V classes (its heads on the
  vocabulary CE kernel for V > 512; columns vocab, vocab_path);
- with --early-update, erase (compiled blocks, and with --paired uncompiled too) with early updates:
  the scheduler steps each segment's SGD right after its backward (Scheduler(optimizer=); column
  early_update=1).

--captures K makes each row the median of K captures, each of a freshly built model (one capture's
replays vary by about ±1-3%).

    python benchmarks/bench_compile.py --out benchmarks/results/bench_compile.csv [--only transformer:1024 ...] [--paired]

--only runs its sizes in the order given (a transformer width covers its sequence lengths).

CUDA only.
"""
import argparse
import statistics
import time

import torch

from erase_triton import LaunchConfig
from erase_triton.kernels.launch import VOCAB_PATHS
from erase_triton.bench import COMPILE_AT, bench_cases, compile_rows, parse_head_every, tf32_metadata, time_step, write_csv


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/bench_compile.csv")
    ap.add_argument("--only", nargs="*", default=None, metavar="MODEL:WIDTH",
                    help="only these sizes of COMPILE_AT (e.g. transformer:1024 ctr:2048)")
    ap.add_argument("--paired", action="store_true", help="also the graphed rows with uncompiled blocks")
    ap.add_argument("--captures", type=int, default=1, help="each row the median of K captures (a fresh model each)")
    ap.add_argument("--beside", default="", help="OCC,...: also erase with compiled blocks and the heads beside the next "
                    "segment at these occupancies (1: the whole device); column beside")
    ap.add_argument("--head-every", default="1",
                    help="K,...: a LocalHead after every K-th of the six blocks (TinyTransformer / CTRConfig(head_every=K)); "
                    "each K in turn; column head_every")
    ap.add_argument("--early-update", action="store_true",
                    help="also erase with early updates (Scheduler(optimizer=)); column early_update")
    ap.add_argument("--vocab", type=int, default=256,
                    help="the transformer's classes (256: bytes; e.g. 32000 runs its heads on the vocabulary CE kernel)")
    ap.add_argument("--vocab-path", default=None, choices=list(VOCAB_PATHS),
                    help="with --vocab > 512: the vocabulary CE path of every head (LaunchConfig.vocab_path)")
    ap.add_argument("--modes", nargs="*", default=["e2e", "sequential", "erase"],
                    choices=["e2e", "sequential", "erase"])
    args = ap.parse_args()
    ks = parse_head_every(args.head_every)
    if args.vocab < 2:
        raise SystemExit(f"--vocab: expected at least 2 classes, got {args.vocab}")
    try:
        besides = [float(o) for o in args.beside.split(",")] if args.beside else []
        for o in besides:
            LaunchConfig(None if o == 1 else o)  # its own check of the fraction
    except ValueError as e:
        raise SystemExit(f"--beside: expected fractions in (0, 1] separated by commas, got {args.beside!r} ({e})")
    if not torch.cuda.is_available():  # the sizes below are the GPU's (bench_cases)
        raise SystemExit("bench_compile.py needs CUDA (the steps are timed with CUDA events)")
    cases = []
    for k in ks:  # with several K every row names its K (column head_every)
        some = [(f"{name}:{desc['width']}", name, dict(desc, head_every=k) if len(ks) > 1 else desc, build)
                for name, desc, build in bench_cases(head_every=k, vocab=args.vocab, vocab_path=args.vocab_path) if (name, desc["width"], desc["batch"]) in COMPILE_AT]
        known = {key for key, *_ in some}
        unknown = sorted(set(args.only or ()) - known)
        if unknown:
            raise SystemExit(f"--only: no compiled size {unknown}; expected some of {sorted(known)}")
        if args.only is not None:  # in the order given
            some = [c for key in dict.fromkeys(args.only) for c in some if c[0] == key]
        cases += some
    meta = tf32_metadata()
    rows = []
    for key, name, desc, build in cases:
        t = time.time()
        got = {}  # (exec, mode, beside) -> [row of each capture]
        for _ in range(args.captures):
            batch = []
            if args.paired:
                for mode in args.modes:
                    model, inputs = build()
                    batch.append(dict(model=name, **desc, exec="graph", mode=mode, **time_step(model, inputs, mode, True)))
                    del model, inputs
                if args.early_update:
                    model, inputs = build()
                    batch.append(dict(model=name, **desc, exec="graph", mode="erase", early_update=1,
                                      **time_step(model, inputs, "erase", True, early_update=True)))
                    del model, inputs
            batch += compile_rows(name, desc, build, log=lambda r: None, modes=args.modes,
                                  early_update=args.early_update)
            for occ in besides:  # erase with compiled blocks, the heads beside the next segment at this occupancy
                model, inputs = build()
                for hd in model.heads:
                    hd.beside_config = LaunchConfig(None if occ == 1 else occ)
                batch.append(dict(model=name, **desc, exec="compile+graph", mode="erase", beside=occ,
                                  **time_step(model, inputs, "erase", True, compiled=True)))
                del model, inputs
                torch._dynamo.reset()
            for r in batch:
                got.setdefault((r["exec"], r["mode"], r.get("beside", ""), r.get("early_update", "")), []).append(r)
        for runs in got.values():
            r = dict(runs[0])
            ms = [x["ms"] for x in runs if "ms" in x]
            if ms:
                r.update(ms=statistics.median(ms), captures=len(ms), ms_each=";".join(f"{m:.4f}" for m in ms))
            rows.append(r)
            print(r, flush=True)
        print(f"{key} s{desc.get('seq', '')} K={desc.get('head_every', 1)}: {time.time() - t:.0f} s", flush=True)
        write_csv(args.out, rows, meta)
        torch.cuda.empty_cache()
    print(f"{'model':12} {'width':>5} {'batch':>6} {'seq':>4} {'K':>2} {'exec':14} {'mode':11} {'beside':>6} {'early':>5} ms")
    for r in rows:
        print(f"{r['model']:12} {r['width']:>5} {r['batch']:>6} {r.get('seq', ''):>4} {r.get('head_every', 1):>2} "
              f"{r['exec']:14} {r['mode']:11} {r.get('beside', ''):>6} {r.get('early_update', ''):>5} "
              f"{r.get('ms', r.get('error'))}")


if __name__ == "__main__":
    main()
