"""A CTR model of the DLRM / DCNv2 family with six detached dense subarchitectures.

    sparse fields -> embedding tables -+
                                        +-> concat -> Linear(width) -> 6 x [cross layer + MLP -> LocalHead(bce)]
    dense fields  -> bottom MLP -------+                                -> over-arch MLP -> final LocalHead(bce)

(CTRConfig(head_every=k): a local head after every k-th subarchitecture only.)

Every subarchitecture ends at a detach point; in "e2e" mode only the final head is
active and the gradient runs through everything. Sizes are configurable, so the same
code is a tiny CPU model and a large GPU proxy.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..chain import check_head_every, run_chain
from ..head import LocalHead
from .embedding import FusedSGDEmbeddings


@dataclasses.dataclass
class CTRConfig:
    n_dense: int
    cardinalities: list[int]
    emb_dim: int = 16
    width: int = 128
    depth: int = 2          # Linear+ReLU layers per subarchitecture
    n_subarch: int = 6
    over_depth: int = 1
    occupancy: float | str | None = "auto"
    backend: str = "auto"
    embedding: str = "table"   # "table": one nn.Embedding per field (dense grads, any optimizer);
                               # "fused_sgd": one weight, SGD fused into backward (FusedSGDEmbeddings)
    embedding_lr: float = 10.0  # the fused SGD step (embedding="fused_sgd" only); on MovieLens-100k
                                # (mean BCE, batch 512): 3 -> test NE 0.945, 10 -> 0.926, 30 diverges
    head_every: int = 1         # a local head after every k-th subarchitecture (k divides n_subarch):
                                # n_subarch / k detach points, each segment k subarchitectures deep


class CrossLayer(nn.Module):
    """DCNv2 cross layer: x0 * (W x + b) + x."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.lin(x) + x


class SubArch(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.cross = CrossLayer(width)
        self.mlp = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.cross(h, h))


def _mlp(d_in: int, width: int, depth: int) -> nn.Sequential:
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    return nn.Sequential(*layers)


class CTRModel(nn.Module):
    def __init__(self, cfg: CTRConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        if cfg.embedding == "table":
            self.embeddings = nn.ModuleList(nn.Embedding(c, cfg.emb_dim) for c in cfg.cardinalities)
            for e in self.embeddings:
                nn.init.normal_(e.weight, std=0.05)
        elif cfg.embedding == "fused_sgd":
            self.embeddings = FusedSGDEmbeddings(cfg.cardinalities, cfg.emb_dim, lr=cfg.embedding_lr)
        else:
            raise ValueError(f"embedding must be 'table' or 'fused_sgd', got {cfg.embedding!r}")
        self.bottom = _mlp(cfg.n_dense, cfg.emb_dim, 1)
        self.proj = nn.Sequential(nn.Linear(cfg.emb_dim * (len(cfg.cardinalities) + 1), w), nn.ReLU())
        k = check_head_every(cfg.head_every, cfg.n_subarch, "n_subarch")
        self.subarchs = nn.ModuleList(SubArch(w, cfg.depth) for _ in range(cfg.n_subarch))
        kw = dict(occupancy=cfg.occupancy, backend=cfg.backend)
        self.heads = nn.ModuleList(LocalHead(w, 1, "bce", **kw) for _ in range(cfg.n_subarch // k))
        self.over = _mlp(w, w, cfg.over_depth)
        self.final_head = LocalHead(w, 1, "bce", final=True, **kw)

    def features(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        n_fields = len(self.cfg.cardinalities)
        if sparse.dim() != 2 or sparse.shape[-1] != n_fields:
            raise ValueError(f"sparse must be [B, {n_fields}] field ids, got {tuple(sparse.shape)}")
        if dense.shape[-1] != self.cfg.n_dense:
            raise ValueError(f"dense must be [B, {self.cfg.n_dense}], got {tuple(dense.shape)}")
        if isinstance(self.embeddings, FusedSGDEmbeddings):
            embs = [self.embeddings(sparse).flatten(1)]
        else:
            embs = [e(sparse[:, i]) for i, e in enumerate(self.embeddings)]
        return self.proj(torch.cat(embs + [self.bottom(dense)], dim=1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        h = run_chain(self.subarchs, self.heads, self.cfg.head_every, self.features(dense, sparse), label)
        return self.final_head(self.over(h), label)

    @torch.no_grad()
    def predict(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Click logits [B] of the final head."""
        h = self.features(dense, sparse)
        for sub in self.subarchs:
            h = sub(h)
        return self.final_head.logits(self.over(h)).squeeze(-1)
