"""MovieLens-100k as a CTR task, read from the installed `recbole` wheel (never committed).

click = rating >= 4. Sparse fields: user, item, age, gender, occupation, zip prefix,
release year; dense: the item's genres (multi-hot) and the normalised release year.
Split chronologically by timestamp: train / validation / test = 80 / 10 / 10 %.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from .tabular import CTRData

INSTALL = "pip install --no-deps recbole==1.2.1"


def _data_dir() -> str:
    spec = importlib.util.find_spec("recbole")  # locate without importing recbole's own deps
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"MovieLens-100k ships inside the recbole wheel; install it with: {INSTALL}")
    d = os.path.join(list(spec.submodule_search_locations)[0], "dataset_example", "ml-100k")
    if not os.path.isfile(os.path.join(d, "ml-100k.inter")):
        raise FileNotFoundError(f"{d} has no ml-100k.inter; reinstall with: {INSTALL}")
    return d


class DataError(ValueError):
    """A data file that does not hold what the loader expects; the message names the file and line."""


def _read(path: str, columns: int, lines: list | None = None) -> list[list[str]]:
    """The rows of a tab-separated atomic file after its header, each with exactly `columns` fields;
    `lines`, if given, receives each row's line number."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        header = f.readline()
        if header.count("\t") + 1 != columns:
            raise DataError(f"{path}:1: expected a header of {columns} tab-separated columns, got {header.strip()!r}")
        for n, line in enumerate(f, start=2):
            if not line.strip():
                continue
            r = line.rstrip("\n").split("\t")
            if len(r) != columns or not r[0]:
                raise DataError(f"{path}:{n}: expected {columns} tab-separated fields with an id first, "
                                f"got {len(r)}: {line.strip()[:80]!r}")
            rows.append(r)
            if lines is not None:
                lines.append(n)
    if not rows:
        raise DataError(f"{path}: no data rows")
    return rows


def _number(path: str, n: int, what: str, text: str, lo: float, hi: float) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not lo <= v <= hi:  # NaN fails too
        raise DataError(f"{path}:{n}: {what} must be a number in [{lo:g}, {hi:g}], got {text!r}")
    return v


class _Vocab(dict):
    """token -> id, 0 kept for unknown."""

    def id(self, tok: str) -> int:
        if tok not in self:
            self[tok] = len(self) + 1
        return self[tok]


def load_movielens(split_fracs=(0.8, 0.1), data_dir: str | None = None) -> tuple[CTRData, CTRData, CTRData]:
    """(train, validation, test). data_dir: a folder with ml-100k.{inter,user,item} in RecBole's atomic
    format (default: the copy inside the installed recbole wheel). A malformed file raises `DataError`
    naming the file and line."""
    if not (len(split_fracs) == 2 and all(0 < f < 1 for f in split_fracs) and sum(split_fracs) < 1):
        raise ValueError(f"split_fracs must be two fractions in (0, 1) summing below 1, got {split_fracs!r}")
    d = data_dir or _data_dir()
    users = {r[0]: r for r in _read(os.path.join(d, "ml-100k.user"), 5)}
    items = {r[0]: r for r in _read(os.path.join(d, "ml-100k.item"), 4)}
    path = os.path.join(d, "ml-100k.inter")
    lines: list = []
    inter = _read(path, 4, lines)
    for n, r in zip(lines, inter):
        if not r[1]:
            raise DataError(f"{path}:{n}: empty item id")
        _number(path, n, "rating", r[2], 1, 5)
        _number(path, n, "timestamp", r[3], 0, float("inf"))
    inter.sort(key=lambda r: float(r[3]))  # chronological
    genres = sorted({g for r in items.values() for g in (r[3].split() if len(r) > 3 else [])})
    gidx = {g: i for i, g in enumerate(genres)}
    fields = ["user", "item", "age", "gender", "occupation", "zip3", "year"]
    vocabs = {f: _Vocab() for f in fields}
    sparse, dense, label = [], [], []
    for u, i, rating, _ts in inter:
        ur = users.get(u, [u, "", "", "", ""])
        ir = items.get(i, [i, "", "", ""])
        age = ur[1]
        age_bucket = str(min(int(age) // 10, 6)) if age.isdigit() else "?"
        year = ir[2] if len(ir) > 2 else ""
        toks = [u, i, age_bucket, ur[2], ur[3], ur[4][:3], year]
        sparse.append([vocabs[f].id(t) for f, t in zip(fields, toks)])
        g = [0.0] * len(genres)
        for name in (ir[3].split() if len(ir) > 3 else []):
            g[gidx[name]] = 1.0
        y = (float(year) - 1990.0) / 20.0 if year.isdigit() else 0.0
        dense.append(g + [y])
        label.append(1.0 if float(rating) >= 4 else 0.0)
    if len(set(label)) < 2:
        raise DataError(f"{path}: every rating gives the label {label[0]:g} (click = rating >= 4): a CTR task needs both")
    cards = [len(vocabs[f]) + 1 for f in fields]
    data = CTRData(torch.tensor(dense), torch.tensor(sparse), torch.tensor(label), cards)
    n = len(label)
    a, b = int(split_fracs[0] * n), int((split_fracs[0] + split_fracs[1]) * n)
    return data.slice(slice(0, a)), data.slice(slice(a, b)), data.slice(slice(b, n))
