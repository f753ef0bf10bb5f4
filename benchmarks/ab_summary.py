"""Summarise an `ab_tree.sh` run: per row, the median over rounds of old and new, and new / old.

    python benchmarks/ab_summary.py OUT_DIR --keys N,D,C,path,occupancy --value us [--out ab.csv]

Rows are matched on the key columns across OUT_DIR/old_R.csv and OUT_DIR/new_R.csv; a ratio
below 1 means the new tree is faster (for a time). Also prints each side's round-to-round spread
(max / min over rounds), the noise a ratio has to clear.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_csv  # noqa: E402


def read_side(out_dir: str, side: str, keys: list[str], value: str) -> dict[tuple, list[float]]:
    runs: dict[tuple, list[float]] = {}
    paths = sorted(glob.glob(os.path.join(out_dir, f"{side}_*.csv")))
    if not paths:
        raise SystemExit(f"no {side}_*.csv under {out_dir}")
    for path in paths:
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get(value):
                    runs.setdefault(tuple(row[k] for k in keys), []).append(float(row[value]))
    return runs


def summarise(out_dir: str, keys: list[str], value: str) -> list[dict]:
    old, new = read_side(out_dir, "old", keys, value), read_side(out_dir, "new", keys, value)
    rows = []
    for k in old:
        if k not in new:
            continue
        o, n = statistics.median(old[k]), statistics.median(new[k])
        rows.append({**dict(zip(keys, k)), f"old_{value}": o, f"new_{value}": n, "new_over_old": n / o,
                     "old_spread": max(old[k]) / min(old[k]), "new_spread": max(new[k]) / min(new[k]),
                     "rounds": min(len(old[k]), len(new[k]))})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--keys", required=True, help="comma-separated columns that name a row")
    ap.add_argument("--value", default="us", help="the column compared")
    ap.add_argument("--out", default=None, help="CSV of the summary (the runs' metadata columns are kept)")
    args = ap.parse_args()
    keys = args.keys.split(",")
    rows = summarise(args.out_dir, keys, args.value)
    if args.out:
        with open(sorted(glob.glob(os.path.join(args.out_dir, "new_*.csv")))[0]) as f:
            first = next(csv.DictReader(f))
        meta = {k: first[k] for k in ("gpu", "torch", "triton") if k in first}
        write_csv(args.out, rows, meta)
    print_table(rows, keys + [f"old_{args.value}", f"new_{args.value}", "new_over_old", "old_spread", "new_spread"])


if __name__ == "__main__":
    main()
