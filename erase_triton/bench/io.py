"""Result files: CSV rows with the GPU and versions on every row, plus <stem>.meta.json with
the GPU, versions, date, git commit and the command that made them."""
from __future__ import annotations

import csv
import json
import os
import platform
import shlex
import subprocess
import sys
import time

import torch

__all__ = ["metadata", "parse_head_every", "print_table", "read_csv", "write_csv"]


def _commit() -> str:
    """The git commit of the working tree (with '+dirty' for uncommitted changes), or 'unknown'."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def metadata() -> dict:
    """GPU, versions, date, commit and command of this process (what a result file records)."""
    import triton

    m = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
         "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _commit(),
         "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.argv[0])] + sys.argv[1:])}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, sms=p.multi_processor_count)
    else:
        m.update(gpu="none (CPU)")
    return m


def write_csv(path: str, rows: list[dict], meta: dict | None = None):
    """CSV with the GPU and versions on every row (a file stands alone), plus <stem>.meta.json."""
    meta = meta or metadata()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(os.path.splitext(path)[0] + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + ["gpu", "torch", "triton"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "gpu": meta.get("gpu"), "torch": meta.get("torch"), "triton": meta.get("triton")})


def read_csv(path: str) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def print_table(rows: list[dict], cols: list[str]):
    """A plain-text table of rows; columns with no value (or only NaN) in any row are left out."""
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
