"""Normalized entropy (NE), AUC and log loss for CTR predictions (no host syncs until read)."""
from __future__ import annotations

import torch

_EPS = 1e-7


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of sigmoid(logits) against {0,1} labels."""
    return torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double())


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """NE = log loss / entropy of the background CTR (torchrec's definition).
    1.0 is a model that predicts the average click rate; lower is better. NaN when every label is
    the same (the background entropy is 0: NE is undefined)."""
    mean = labels.double().mean()
    p = mean.clamp(_EPS, 1 - _EPS)
    base = -(p * p.log() + (1 - p) * (1 - p).log())
    one_class = (mean <= 0) | (mean >= 1)
    return torch.where(one_class, torch.full_like(base, float("nan")), log_loss(logits, labels) / base)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties)."""
    s = scores.double().flatten()
    y = labels.double().flatten()
    order = torch.argsort(s)
    s_sorted = s[order]
    ranks = torch.empty_like(s)
    # average rank inside groups of equal scores
    _, inverse, counts = torch.unique_consecutive(s_sorted, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg = ends - (counts.double() - 1) / 2
    ranks[order] = avg[inverse]
    n_pos = y.sum()
    n_neg = len(y) - n_pos
    # NaN when one class is missing (0/0 or x/0 made explicit)
    u = ranks[y > 0.5].sum() - n_pos * (n_pos + 1) / 2
    return torch.where(n_pos * n_neg > 0, u / (n_pos * n_neg).clamp_min(1), torch.full_like(u, float("nan")))
