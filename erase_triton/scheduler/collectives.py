"""Collectives the scheduler issues for data-parallel models (erase_triton.distributed): the
group a model's gradients are averaged over, a flat all-reduce of a segment's gradients, and
the row gather that keeps fused-SGD embedding tables identical on every rank."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = ["DataParallelGroup", "all_reduce_grads", "gather_rows"]


@dataclasses.dataclass(frozen=True, eq=False)
class DataParallelGroup:
    """The process group a data-parallel model's gradients are averaged over."""

    group: object  # a ProcessGroup, or None for the default group
    world_size: int
    rank: int
    params: tuple = ()  # the model's parameters whose .grad is averaged (FusedSGDEmbeddings' weights excluded)
    local: bool = False  # a rank-local model (`local_only`): no collectives
    sharded: bool = False  # some segment bodies are FSDP's (fully_shard): not capturable


def all_reduce_grads(params, dp: DataParallelGroup) -> int:
    """Average the .grad of `params` over dp's ranks: one flat buffer per dtype, summed with
    all_reduce on the current stream, divided by the world size, copied back. Parameters
    without a .grad are skipped (the same ones on every rank: the same model code). Returns
    the number of gradients averaged."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0
    by_dtype: dict = {}
    for g in grads:
        if g.layout != torch.strided:
            raise ValueError(f"data_parallel averages dense gradients; a parameter of shape {tuple(g.shape)} has a "
                             f"{g.layout} gradient (an embedding with sparse=True?): make it dense")
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for gs in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=dp.group)
        flat.div_(dp.world_size)
        torch._foreach_copy_(gs, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in gs]), gs)])
    return len(grads)


def gather_rows(idx: torch.Tensor, rows: torch.Tensor, dp: DataParallelGroup):
    """(every rank's idx, every rank's rows / world size), concatenated in rank order: the
    union batch's sparse gradient, for a row update that stays identical on every rank.
    Every rank must pass the same shapes (the same batch size)."""
    idxs = [torch.empty_like(idx) for _ in range(dp.world_size)]
    rowss = [torch.empty_like(rows) for _ in range(dp.world_size)]
    dist.all_gather(idxs, idx.contiguous(), group=dp.group)
    dist.all_gather(rowss, rows.contiguous(), group=dp.group)
    return torch.cat(idxs), torch.cat(rowss).div_(dp.world_size)
