"""Plots from result CSVs (matplotlib, headless). `erase-triton plot FILE.csv ...` picks
the plot from the file's columns, so committed H200 results can be drawn on any machine."""
from __future__ import annotations

import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .io import read_csv  # noqa: E402

PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "head": "#C44E52", "optimizer": "#8C8C8C",
                "fwd/bwd (graph)": "#55A868"}


def _f(r, k, default=float("nan")):
    try:
        return float(r[k])
    except (KeyError, TypeError, ValueError):
        return default


def _save(fig, path: str):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gpu(rows) -> str:
    r = rows[0] if rows else {}
    return f"{r.get('gpu', '?')}, torch {r.get('torch', '?')}, triton {r.get('triton', '?')}"


def plot_timeline(kernels: list[dict], path: str, title: str = ""):
    """One lane per CUDA stream; bars coloured by phase (forward / backward / head / optimizer)."""
    streams = sorted({k["stream"] for k in kernels})
    lane = {s: i for i, s in enumerate(streams)}
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * len(streams)))
    bars = defaultdict(list)  # (phase, stream) -> [(start, width)]
    for k in kernels:
        bars[(k["phase"], k["stream"])].append((k["start"], max(k["end"] - k["start"], 0.3)))
    for phase, color in PHASE_COLORS.items():
        for s in streams:
            if bars.get((phase, s)):
                ax.broken_barh(bars[(phase, s)], (lane[s] - 0.4, 0.8), color=color)
        if any(ph == phase for ph, _ in bars):
            ax.plot([], [], color=color, lw=8, label=phase)
    ax.set_yticks(range(len(streams)))
    ax.set_yticklabels([f"stream {s}" for s in streams])
    ax.set_xlabel("time (µs)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper right", ncol=4, fontsize=8)
    _save(fig, path)


def plot_sweep(rows: list[dict], path: str):
    """Step time against occupancy, one panel per model size; the best setting marked."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["model"], r.get("width"), r.get("batch"), r.get("seq", ""))].append(r)
    n = len(groups)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    for ax, (key, rs) in zip(axes[0], groups.items()):
        series = defaultdict(list)
        for r in rs:
            series[f"{r['exec']}, ring {r['streams']}"].append((_f(r, "occupancy"), _f(r, "ms")))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            best = min(pts, key=lambda p: p[1])
            ax.scatter([best[0]], [best[1]], s=120, facecolors="none", edgecolors="k")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("head occupancy (fraction of SMs)")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{key[0]} w{key[1]} b{key[2]}" + (f" s{key[3]}" if key[3] else ""), fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"erase step time vs occupancy ({_gpu(rows)}); circles: best", fontsize=9)
    _save(fig, path)


def plot_bench(rows: list[dict], path: str):
    """Throughput relative to graphed e2e, per model size: erase, sequential, compile (e2e compiled
    whole; erase / sequential with compiled blocks; erase with early updates, bench_compile
    --early-update). Without graphed e2e rows (bench_compile without --paired) the baseline is the
    graphed compiled e2e step. Sizes with a head every K blocks (column head_every) are their own
    groups, labelled K=k. Rows at another head occupancy (a `beside` value, bench_compile --beside)
    are left out."""
    by = defaultdict(dict)
    for r in rows:
        if "ms" in r and r["ms"] not in ("", None) and r.get("beside") in (None, ""):
            mode = r["mode"] + (", early updates" if str(r.get("early_update", "")) in ("1", "True") else "")
            key = (r["model"], r.get("width"), r.get("batch"), r.get("seq", ""), r.get("head_every") or "1")
            by[key][(r["exec"], mode)] = _f(r, "ms")
    models = sorted({k[0] for k in by})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5.2), squeeze=False)
    num = lambda v: int(v) if str(v).isdigit() else 0  # noqa: E731
    for ax, m in zip(axes[0], models):
        keys = sorted((k for k in by if k[0] == m), key=lambda k: (num(k[1]), num(k[2]), num(k[3]), num(k[4])))
        show_k = any(k[4] != "1" for k in keys)
        labels = [f"w{k[1]}\nb{k[2]}" + (f"\ns{k[3]}" if k[3] else "") + (f"\nK={k[4]}" if show_k else "")
                  for k in keys]
        ref = ("graph", "e2e") if all(("graph", "e2e") in by[k] for k in keys) else ("compile+graph", "e2e")
        variants = [v for v in [("graph", "erase"), ("graph", "erase, early updates"), ("graph", "sequential"),
                                ("compile", "e2e"), ("compile+graph", "e2e"), ("compile+graph", "sequential"),
                                ("compile+graph", "erase"), ("compile+graph", "erase, early updates"), ("eager", "erase")]
                    if any(v in by[k] for k in keys)]
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            base = [by[k].get(ref, float("nan")) for k in keys]
            vals = [b / by[k].get(v, float("nan")) for b, k in zip(base, keys)]
            label = (f"{v[1]}, compiled blocks (graph)" if v[0] == "compile+graph" and v[1] != "e2e"
                     else f"{v[1]} compiled whole ({v[0]})" if v[0].startswith("compile") else f"{v[1]} ({v[0]})")
            ax.bar([j + i * width for j in range(len(keys))], vals, width, label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("speedup over graphed e2e" if ref[0] == "graph" else "speedup over graphed compiled e2e")
        ax.set_title(m)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)  # below: never over a bar
    fig.suptitle(f"Speedup curves ({_gpu(rows)})", fontsize=9)
    _save(fig, path)


def plot_early_update(rows: list[dict], path: str):
    """bench_early_update.py: graphed erase with early updates against the update at the end, per
    size and optimizer (left), and the Adam steps against the strongest Adam baseline, graphed e2e
    with fused Adam (right; without an adam-fused row, each optimizer's own e2e; with --compiled,
    the e2e step has compiled blocks too)."""
    rs = [r for r in rows if r.get("early_vs_end") not in (None, "")]
    sizes = list(dict.fromkeys(r["size"] for r in rs))
    opts = list(dict.fromkeys(r["optimizer"] for r in rs))
    by = {(r["size"], r["optimizer"]): r for r in rs}
    fused = "adam-fused" in opts
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))

    def bars(ax, series, ylabel):
        width = 0.8 / len(series)
        for i, (label, value) in enumerate(series):
            ax.bar([j + i * width for j in range(len(sizes))], [value(sz) for sz in sizes], width, label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))])
        ax.set_xticklabels([s.replace(":", "\n", 1) for s in sizes], fontsize=7)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)

    def get(sz, o, col):
        r = by.get((sz, o))
        return _f(r, col) if r else float("nan")
    bars(axes[0], [(o, lambda sz, o=o: get(sz, o, "early_vs_end")) for o in opts],
         "erase: early updates / update at the end")
    adams = [o for o in opts if o.startswith("adam")]
    base = (lambda sz, o: get(sz, "adam-fused", "e2e_ms")) if fused else (lambda sz, o: get(sz, o, "e2e_ms"))
    bars(axes[1], [(f"{o}: erase, {what}", lambda sz, o=o, col=col: base(sz, o) / get(sz, o, col))
                   for o in adams for what, col in (("update at the end", "erase_ms"), ("early updates", "erase_early_ms"))],
         "speedup over graphed e2e" + (" (compiled blocks)" if any(str(r.get("compiled")) == "1" for r in rs) else "")
         + " with " + ("fused Adam" if fused else "the same optimizer"))
    fig.suptitle(f"Early updates, graphed steps ({_gpu(rows)})", fontsize=9)
    _save(fig, path)


def plot_schedule(rows: list[dict], path: str):
    """bench_schedule.py summary: graphed erase vs sequential and fused vs PyTorch heads."""
    rs = [r for r in rows if "graph_erase_vs_seq" in r]
    labels = [f"{r['model'][:3]} w{r['width']}\nb{r['batch']} {r['dtype']}"
              + ("\nReLU in head" if str(r.get("relu_in_head", "")) in ("1", "True") else "") for r in rs]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rs)), 5.5))
    series = [("graph_erase_vs_seq", "erase / sequential (graphed)"), ("graph_erase_vs_e2e", "erase fused / e2e (graphed)"),
              ("graph_fused_vs_torch_heads", "fused / PyTorch heads (graphed erase)"),
              ("graph_fused_vs_compiled_heads", "fused / compiled PyTorch heads (torch.compile, graphed erase)"),
              ("graph_compiled_vs_torch_heads", "compiled / plain PyTorch heads (graphed erase)"),
              ("graph_free_vs_torch_heads", "zero-cost heads (constant gradient) / PyTorch heads (graphed erase)"),
              ("graph_free_replayed_vs_torch_heads", "zero-cost heads replaying a real gradient / PyTorch heads: "
                                                     "the most any head buys"),
              ("eager_erase_vs_seq", "erase / sequential (eager)"),
              ("eager_erase_vs_seq_paired", "erase / sequential (eager, paired: median of per-round ratios)"),
              ("eager_again_vs_seq_paired", "sequential / sequential again (eager A/A, paired)"),
              ("eager_erase_vs_seq_wall", "erase / sequential (eager, wall clock of blocks of steps: a run's throughput)"),
              ("eager_always_fork_vs_seq_wall", "erase forking every step / sequential (eager, wall clock)"),
              ("eager_again_vs_seq_wall", "sequential / sequential again (eager A/A, wall clock)"),
              ("eager_again_vs_seq", "sequential / sequential again (eager A/A: the noise)")]
    series = [(k, lab) for k, lab in series if any(r.get(k) not in ("", None, "nan") for r in rs)]
    w = 0.8 / len(series)
    for i, (k, lab) in enumerate(series):
        ax.bar([j + i * w for j in range(len(rs))], [_f(r, k) for r in rs], w, label=lab)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(rs))])
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("speedup")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # below: never over a bar
    ax.set_title(f"Step-time speedups ({_gpu(rows)})", fontsize=9)
    _save(fig, path)


def plot_local_head(rows: list[dict], path: str):
    """Fused head time vs baselines per config, with the HBM/matmul floor. Variants with a setting
    in their name ("ours occupancy=0.125", "ours-row_chunks chunk_size=512") are left out."""
    rs = [r for r in rows if r.get("us") and " " not in r["variant"]]
    cfgs = []
    for r in rs:
        k = (r["loss"], r["N"], r["D"], r["C"], r["dtype"])
        if k not in cfgs:
            cfgs.append(k)
    # every variant with a time, baselines first, each group in the file's order
    variants = sorted(dict.fromkeys(r["variant"] for r in rs), key=lambda v: v.startswith("ours"))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cfgs)) + 2.5, 4.2))
    w = 0.8 / len(variants)
    for i, v in enumerate(variants):
        vals = [next((_f(r, "us") for r in rs if (r["loss"], r["N"], r["D"], r["C"], r["dtype"]) == k
                      and r["variant"] == v), float("nan")) for k in cfgs]
        # (tab20 past 10 variants: the default cycle would repeat a colour)
        color = plt.get_cmap("tab20" if len(variants) > 10 else "tab10")(i)
        ax.bar([j + i * w for j in range(len(cfgs))], vals, w, label=v, color=color)
    floors = [next(_f(r, "floor_us") for r in rs if (r["loss"], r["N"], r["D"], r["C"], r["dtype"]) == k) for k in cfgs]
    ax.scatter([j + 0.4 - w / 2 for j in range(len(cfgs))], floors, marker="_", s=400, color="k", label="floor", zorder=3)
    ax.set_yscale("log")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cfgs))])
    ax.set_xticklabels([f"{k[0]} N{k[1]}\nD{k[2]} C{k[3]}\n{k[4]}" for k in cfgs], fontsize=7)
    ax.set_ylabel("µs per head call (loss + all grads)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes: never over a bar
    ax.set_title(f"Fused local head ({_gpu(rows)})", fontsize=9)
    _save(fig, path)


def plot_quality(rows: list[dict], path: str):
    """NE (ctr) or perplexity (transformer) per mode, mean ± std over seeds."""
    metric_of = {m: "ne" if m.startswith("ctr") else "perplexity" for m in dict.fromkeys(r["model"] for r in rows)}
    fig, axes = plt.subplots(1, len(metric_of), figsize=(4.5 * len(metric_of), 3.6), squeeze=False)
    colors = {"e2e": "#4C72B0", "sequential": "#55A868", "erase": "#DD8452"}
    lims = defaultdict(list)  # one y-range for every panel of a metric, so bars compare across panels
    for r in rows:
        lims[metric_of[r["model"]]].append(_f(r, f"{metric_of[r['model']]}_mean"))
    for ax, (model, metric) in zip(axes[0], metric_of.items()):
        rs = [r for r in rows if r["model"] == model]
        modes = [m for m in colors if any(r["mode"] == m for r in rs)]
        means = [_f(next(r for r in rs if r["mode"] == m), f"{metric}_mean") for m in modes]
        stds = [_f(next(r for r in rs if r["mode"] == m), f"{metric}_std", 0.0) for m in modes]
        ax.bar(modes, means, yerr=stds, capsize=4, color=[colors[m] for m in modes])
        ax.set_ylim(min(lims[metric]) * 0.95, max(lims[metric]) * 1.03)
        ax.set_title(f"{model}: {metric} (mean ± std over seeds)", fontsize=9)
    _save(fig, path)


def plot_file(csv_path: str, out_dir: str | None = None) -> str:
    """Draw the plot that fits a result CSV's columns; returns the PNG path."""
    rows = read_csv(csv_path)
    if not rows:
        raise ValueError(f"{csv_path} has no rows")
    cols = set(rows[0])
    stem = os.path.splitext(os.path.basename(csv_path))[0]
    folder = out_dir or os.path.dirname(csv_path) or "."
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, stem + ".png")
    if {"early_vs_end", "optimizer"} <= cols:
        plot_early_update(rows, out)
    elif {"occupancy", "streams", "ms"} <= cols and "heads" not in cols:
        plot_sweep(rows, out)
    elif "graph_erase_vs_seq" in cols:
        plot_schedule(rows, out)
    elif {"variant", "floor_us"} <= cols:
        plot_local_head(rows, out)
    elif "ne_mean" in cols or "perplexity_mean" in cols:
        plot_quality(rows, out)
    elif {"exec", "mode", "ms"} <= cols and "heads" not in cols:  # raw schedule.csv: see its _summary
        plot_bench(rows, out)
    else:
        raise ValueError(f"{csv_path}: unknown result columns {sorted(cols)}")
    return out


def plot_training(result: dict, path: str):
    """The training loss of a run (`erase-triton train`), smoothed, with its validation metric."""
    import torch
    import triton

    loss = result.get("train_loss") or []
    fig, ax = plt.subplots(figsize=(7, 3.6))
    if loss:
        k = max(1, len(loss) // 50)
        smooth = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1]) for i in range(len(loss))]
        ax.plot(range(1, len(loss) + 1), loss, color="#C8C8C8", lw=0.8, label="final head loss")
        ax.plot(range(1, len(loss) + 1), smooth, color="#4C72B0", lw=1.8, label=f"mean of {k} steps")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    hist = result.get("history") or []
    key = next((k for k in ("val_ne", "val_perplexity") if hist and k in hist[0]), None)
    if key:
        ax2 = ax.twinx()
        ax2.plot([h["step"] for h in hist], [h[key] for h in hist], "o-", color="#C44E52", label=key.replace("_", " "))
        ax2.set_ylabel(key.replace("_", " "), color="#C44E52")
        ax2.legend(loc="center right", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    dev = result.get("device", "?")
    if dev.startswith("cuda") and torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
    world = result.get("world_size", 1)
    ax.set_title(f"{result.get('model')}/{result.get('data')} mode={result.get('mode')} head_every="
                 f"{result.get('head_every')}{f' x{world} ranks' if world > 1 else ''}\n{dev}, torch "
                 f"{torch.__version__}, triton {triton.__version__}", fontsize=9)
    _save(fig, path)
