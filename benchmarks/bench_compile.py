"""The torch.compile(e2e) baselines of the speedup study alone (no erase rows): compiled with the
host issuing every kernel ("compile") and the whole compiled step in one CUDA graph
("compile+graph"), at the sizes `erase-triton bench` compiles (study.COMPILE_AT), or a few of them.

    python benchmarks/bench_compile.py --out benchmarks/results/bench_compile.csv [--only transformer:1024 ...]

Compare the rows with the graphed e2e / erase rows of `bench.csv` (same sizes, same models). CUDA only.
"""
import argparse

import torch

from erase_triton.study import COMPILE_AT, _tf32_metadata, bench_cases, compile_rows, write_csv


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/bench_compile.csv")
    ap.add_argument("--only", nargs="*", default=None, metavar="MODEL:WIDTH",
                    help="only these sizes of COMPILE_AT (e.g. transformer:1024 ctr:2048)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_compile.py needs CUDA (the baselines are timed with CUDA events)")
    cases = [(f"{name}:{desc['width']}", name, desc, build) for name, desc, build in bench_cases()
             if (name, desc["width"], desc["batch"]) in COMPILE_AT]
    known = {key for key, *_ in cases}
    unknown = sorted(set(args.only or ()) - known)
    if unknown:
        raise SystemExit(f"--only: no compiled size {unknown}; expected some of {sorted(known)}")
    meta = _tf32_metadata()
    rows = []
    for key, name, desc, build in cases:
        if args.only is not None and key not in args.only:
            continue
        rows += compile_rows(name, desc, build)
        write_csv(args.out, rows, meta)
    print(f"{'model':12} {'width':>5} {'batch':>6} {'exec':14} ms")
    for r in rows:
        print(f"{r['model']:12} {r['width']:>5} {r['batch']:>6} {r['exec']:14} {r.get('ms', r.get('error'))}")


if __name__ == "__main__":
    main()
