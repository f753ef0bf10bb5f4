"""Seeded synthetic Criteo-shaped CTR data: 13 dense + 26 sparse fields, power-law ids,
labels drawn from a hidden teacher (so the task is learnable and NE is meaningful)."""
from __future__ import annotations

import torch

from .tabular import CTRData


def synthetic_criteo(n: int, cardinality: int = 100_000, n_dense: int = 13, n_sparse: int = 26,
                     alpha: float = 1.1, ctr: float = 0.25, seed: int = 0, device="cpu") -> CTRData:
    """n rows. Sparse ids ~ Zipf(alpha) over `cardinality` per field; dense ~ log-normal.
    Teacher: logit = dense . a + sum_f t_f[id_f] + pairwise term, shifted to the target CTR."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ranks = torch.arange(1, cardinality + 1, dtype=torch.float64)
    p = ranks.pow(-alpha)
    p /= p.sum()
    sparse = torch.multinomial(p.float(), n * n_sparse, replacement=True, generator=g).view(n, n_sparse)
    perm = torch.randperm(cardinality, generator=g)  # popular ids scattered over the table
    sparse = perm[sparse]
    dense = torch.exp(torch.randn(n, n_dense, generator=g) * 0.8).log1p()
    a = torch.randn(n_dense, generator=g) * 0.5
    tables = torch.randn(n_sparse, cardinality, generator=g) * 0.6
    vecs = torch.randn(n_sparse, cardinality, 4, generator=g) * 0.4
    logit = (dense - dense.mean(0)) @ a
    logit += tables.gather(1, sparse.t()).t().sum(1) / n_sparse ** 0.5
    e = vecs[torch.arange(n_sparse)[None, :], sparse]  # [n, F, 4]
    logit += (e[:, :13].sum(1) * e[:, 13:].sum(1)).sum(1) / n_sparse
    # shift so the mean click rate is about `ctr`
    lo, hi = -20.0, 20.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if torch.sigmoid(logit + mid).mean() > ctr:
            hi = mid
        else:
            lo = mid
    label = torch.bernoulli(torch.sigmoid(logit + lo), generator=g)
    data = CTRData(dense.float(), sparse.long(), label.float(), [cardinality] * n_sparse)
    return data.to(device)
