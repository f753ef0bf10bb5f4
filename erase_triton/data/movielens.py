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


def _read(path: str) -> list[list[str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        next(f)  # header
        return [line.rstrip("\n").split("\t") for line in f if line.strip()]


class _Vocab(dict):
    """token -> id, 0 kept for unknown."""

    def id(self, tok: str) -> int:
        if tok not in self:
            self[tok] = len(self) + 1
        return self[tok]


def load_movielens(split_fracs=(0.8, 0.1)) -> tuple[CTRData, CTRData, CTRData]:
    d = _data_dir()
    users = {r[0]: r for r in _read(os.path.join(d, "ml-100k.user"))}
    items = {r[0]: r for r in _read(os.path.join(d, "ml-100k.item"))}
    inter = _read(os.path.join(d, "ml-100k.inter"))
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
    cards = [len(vocabs[f]) + 1 for f in fields]
    data = CTRData(torch.tensor(dense), torch.tensor(sparse), torch.tensor(label), cards)
    n = len(label)
    a, b = int(split_fracs[0] * n), int((split_fracs[0] + split_fracs[1]) * n)
    return data.slice(slice(0, a)), data.slice(slice(a, b)), data.slice(slice(b, n))
