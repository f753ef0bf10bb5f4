"""Embedding tables for the CTR model.

`FusedSGDEmbeddings` keeps every table in one [sum(cardinalities), dim] weight and fuses
the optimizer into the backward, as production CTR trainers do (FBGEMM's table-batched
embeddings with an in-backward optimizer, TorchRec's fused optimizers): the backward
adds ``-lr * grad`` to the rows the batch touched (duplicates summed) and gives the
weight no ``.grad``. No dense [rows, dim] gradient is materialised, zeroed or stepped,
which with 26 tables of 100k rows is ~666 MB of memory traffic per step that no
schedule can overlap. The update is plain SGD, so it equals "dense gradient, then
``SGD.step``" (to floating-point summation order: duplicates are added with atomics).

Shapes are static and nothing syncs with the host, so the step stays graph-capturable.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..scheduler.collectives import gather_rows

__all__ = ["FusedSGDEmbeddings"]


class _LookupSGD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, idx, lr, dp):
        ctx.save_for_backward(idx, lr)
        ctx.weight, ctx.dp = weight, dp
        return weight[idx]

    @staticmethod
    def backward(ctx, grad):
        idx, lr = ctx.saved_tensors
        w, dp = ctx.weight, ctx.dp
        with torch.no_grad():
            rows, idx = grad.reshape(-1, w.shape[1]), idx.reshape(-1)
            if dp is not None:
                # every rank applies the union batch's rows, so the tables stay identical
                idx, rows = gather_rows(idx, rows, dp)
            w.index_add_(0, idx, rows.to(w.dtype) * (-lr).to(w.dtype))
        return None, None, None, None


@torch.compiler.disable  # an in-place update of a leaf in backward: torch.compile runs it eagerly
def _lookup_sgd(weight, idx, lr, dp=None):
    return _LookupSGD.apply(weight, idx, lr, dp)


class FusedSGDEmbeddings(nn.Module):
    """T tables of dim columns in one weight; ``forward(ids [B, T]) -> [B, T, dim]``.

    lr: the SGD step of the rows a batch touches, applied in backward (a buffer, so
    ``set_lr`` reaches a captured CUDA graph). The weight is a Parameter (it moves with
    ``.to()`` and is saved in the state dict) that never gets a ``.grad``; optimizers skip it.
    Ids are range-checked per field on CPU. On CUDA they are not (a check would sync with
    the host every step): an id past its field's cardinality reads the next table's rows,
    and only ids outside the whole weight trip PyTorch's device-side index assert.
    """

    data_parallel = None  # set by erase_triton.distributed.data_parallel: updates with every rank's rows

    def __init__(self, cardinalities: list[int], dim: int, lr: float = 10.0, std: float = 0.05):
        super().__init__()
        if not cardinalities or min(cardinalities) < 1:
            raise ValueError(f"cardinalities must be a non-empty list of positive ints, got {cardinalities!r}")
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        self.cardinalities, self.dim = list(cardinalities), dim
        self.weight = nn.Parameter(torch.empty(sum(cardinalities), dim).normal_(0, std))
        offsets = torch.tensor([0] + list(cardinalities[:-1])).cumsum(0)
        self.register_buffer("offsets", offsets, persistent=False)
        self.register_buffer("cards", torch.tensor(self.cardinalities), persistent=False)
        self.register_buffer("lr", torch.tensor(float(lr)), persistent=False)

    def set_lr(self, lr: float):
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        self.lr.fill_(lr)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != len(self.cardinalities):
            raise ValueError(f"ids must be [B, {len(self.cardinalities)}] field ids, got {tuple(ids.shape)}")
        if ids.device.type == "cpu":  # free here; on CUDA it would cost a host sync (see the class docstring)
            bad = (ids < 0) | (ids >= self.cards)
            if bool(bad.any()):
                f = int(bad.nonzero()[0, 1])
                raise ValueError(f"ids[:, {f}] must be in [0, {self.cardinalities[f]}) (field {f}'s cardinality)")
        idx = ids + self.offsets
        if not (torch.is_grad_enabled() and self.training and self.weight.requires_grad):
            return self.weight[idx]
        return _lookup_sgd(self.weight, idx, self.lr, self.data_parallel)

    def extra_repr(self) -> str:
        return f"tables={len(self.cardinalities)}, rows={self.weight.shape[0]}, dim={self.dim}, fused SGD"
