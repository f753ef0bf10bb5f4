"""Shared helpers of the benchmark scripts: metadata, CSV writing, timing."""
from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import time

import torch


def metadata() -> dict:
    import triton

    m = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
         "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda)
    else:
        m.update(gpu="none (CPU)")
    return m


def write_csv(path: str, rows: list[dict], meta: dict):
    """CSV with the GPU/version metadata repeated on every row (one file stands alone)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    keys = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    mkeys = ["gpu", "torch", "triton"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + mkeys)
        w.writeheader()
        for r in rows:
            w.writerow({**r, **{k: meta.get(k, "") for k in mkeys}})
    with open(os.path.splitext(path)[0] + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)


def cuda_median_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median of per-call CUDA-event times (each call timed on its own)."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written), measured now."""
    import triton.testing

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def print_table(rows: list[dict], cols: list[str]):
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
