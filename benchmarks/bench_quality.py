"""Model quality per mode: NE/AUC on MovieLens-100k (seeds) and byte-LM perplexity.

    python benchmarks/bench_quality.py [--seeds 3] [--out benchmarks/results/quality.csv]
    python benchmarks/bench_quality.py --seeds 0 --lm-seeds 3 --head-every 1,2,3 --modes e2e erase \
        --out benchmarks/results/quality_lm.csv     # the LM with a head every K layers (model transformer_kK)
    python benchmarks/bench_quality.py --seeds 3 --lm-seeds 0 --head-every 1,2,3 --embedding table \
        --modes e2e erase --out benchmarks/results/quality_ctr.csv   # the CTR model likewise (model ctr_kK)

Runs on CPU or GPU (same code as `erase-triton train`). Writes per-run rows and a
mean ± std summary (quality_summary.csv), and plots the summary; --from-csv RUNS.csv rebuilds the
summary and plot of an earlier run without training.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from erase_triton.bench import metadata, parse_head_every, print_table, read_csv, write_csv
from erase_triton.bench.plots import plot_quality
from erase_triton.train import train_ctr, train_transformer

MODES = ["e2e", "sequential", "erase"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lm-seeds", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/quality.csv")
    ap.add_argument("--head-every", default="1", help="K,...: both models with a local head after every K-th of "
                    "their six blocks (TinyTransformer / CTRConfig(head_every=K)); rows of model transformer, ctr, "
                    "ctr_fused_sgd (K=1) or the same with _kK")
    ap.add_argument("--modes", nargs="*", default=MODES, choices=MODES)
    ap.add_argument("--embedding", choices=["table", "fused_sgd", "both"], default="both",
                    help="CTR tables: nn.Embedding + Adam (model 'ctr') and/or fused SGD ('ctr_fused_sgd')")
    ap.add_argument("--from-csv", default=None, metavar="RUNS.csv",
                    help="train nothing: rebuild RUNS_summary.csv and its plot from a per-run CSV this script wrote")
    args = ap.parse_args()
    if args.from_csv:
        if not os.path.isfile(args.from_csv):
            raise SystemExit(f"--from-csv: no file {args.from_csv!r}")
        rows = read_csv(args.from_csv)
        meta_path = os.path.splitext(args.from_csv)[0] + ".meta.json"
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
        else:  # every row carries the GPU and versions (write_csv)
            meta = {k: rows[0][k] for k in ("gpu", "torch", "triton") if rows and k in rows[0]}
        write_summary(rows, MODES, args.from_csv, meta)
        return
    ks = parse_head_every(args.head_every)
    modes = list(args.modes)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    meta = metadata()
    rows = []
    embeddings = ["table", "fused_sgd"] if args.embedding == "both" else [args.embedding]
    for emb in embeddings:
        for k in ks:
            name = ("ctr" if emb == "table" else f"ctr_{emb}") + ("" if k == 1 else f"_k{k}")
            for seed in range(args.seeds):
                for mode in modes:
                    r = train_ctr(mode=mode, seed=seed, device=dev, progress=False, embedding=emb, head_every=k)
                    rows.append(dict(model=name, mode=mode, seed=seed, ne=r["ne"], auc=r["auc"], logloss=r["logloss"],
                                     examples_per_s=r["examples_per_s"], device=dev))
                    print(rows[-1], flush=True)
    for k in ks:
        for seed in range(args.lm_seeds):
            for mode in modes:
                r = train_transformer(mode=mode, seed=seed, device=dev, progress=False, head_every=k)
                rows.append(dict(model="transformer" if k == 1 else f"transformer_k{k}", mode=mode, seed=seed,
                                 perplexity=r["perplexity"], examples_per_s=r["examples_per_s"], device=dev))
                print(rows[-1], flush=True)
    write_csv(args.out, rows, meta)
    write_summary(rows, modes, args.out, meta)


def summarize(rows: list[dict], modes) -> list[dict]:
    """Mean ± std over seeds of each (model, mode), and the mean's change against e2e in %."""
    summary = []
    for model in dict.fromkeys(r["model"] for r in rows):
        metrics = ["ne", "auc"] if model.startswith("ctr") else ["perplexity"]
        for mode in modes:
            rs = [r for r in rows if r["model"] == model and r["mode"] == mode]
            if not rs:
                continue
            s = dict(model=model, mode=mode, runs=len(rs))
            for m in metrics:
                v = [float(r[m]) for r in rs]
                s[f"{m}_mean"] = statistics.fmean(v)
                s[f"{m}_std"] = statistics.stdev(v) if len(v) > 1 else 0.0
            summary.append(s)
    base = {s["model"]: s for s in summary if s["mode"] == "e2e"}
    for s in summary:
        key = "ne_mean" if s["model"].startswith("ctr") else "perplexity_mean"
        if s["model"] in base:
            s["rel_to_e2e_pct"] = 100 * (s[key] / base[s["model"]][key] - 1)
    return summary


def write_summary(rows: list[dict], modes, out: str, meta: dict):
    """OUT_summary.csv and its plot OUT_summary.png from the per-run rows, and the table."""
    summary = summarize(rows, modes)
    path = os.path.splitext(out)[0] + "_summary.csv"
    write_csv(path, summary, meta)
    plot_quality([{k: str(v) for k, v in s.items()} for s in summary], os.path.splitext(path)[0] + ".png")
    print_table(summary, ["model", "mode", "runs", "ne_mean", "ne_std", "auc_mean", "perplexity_mean", "rel_to_e2e_pct"])


if __name__ == "__main__":
    main()
