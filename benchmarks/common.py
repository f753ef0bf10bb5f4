"""Shared helpers of the benchmark scripts (metadata, CSV and timing live in erase_triton.study)."""
from __future__ import annotations

import time

import torch

from erase_triton.study import median_ms as cuda_median_ms  # noqa: F401  (re-exported)
from erase_triton.study import metadata, write_csv  # noqa: F401


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written), measured now."""
    import triton.testing

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def host_us(fn, n: int = 2000, warmup: int = 50) -> float:
    """Host time per call (µs) of fn issued back to back; the device is synchronised only
    around the loop, so with the GPU idle this is what the CPU spends issuing one call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def print_table(rows: list[dict], cols: list[str]):
    """Columns with no value (or only NaN) in any row are left out."""
    cols = [c for c in cols if any(_fmt(r.get(c)) not in ("", "nan") for r in rows)] or cols
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def parse_head_every(text: str) -> list[int]:
    """--head-every K[,K...]: divisors of the models' six blocks, or SystemExit naming the option."""
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        ks = []
    if not ks or any(k < 1 or 6 % k for k in ks):
        raise SystemExit(f"--head-every: expected 1, 2, 3 or 6 (divisors of the models' 6 blocks) separated by commas, "
                         f"got {text!r}")
    return ks
