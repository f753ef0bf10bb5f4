"""Data-parallel ERASE on torch.distributed: each segment's gradients all-reduced right after
its early backward, while later segments run their forward.

    import torch.distributed as dist
    from erase_triton.distributed import data_parallel
    dist.init_process_group("nccl")               # or "gloo" on CPUs; torchrun sets the rest
    model = data_parallel(model)                  # same model object, same state_dict keys
    sched = Scheduler("erase")
    with sched.step():                            # each rank: its own shard of the batch
        opt.zero_grad(set_to_none=True); model(x, y); opt.step()

How: `data_parallel` broadcasts rank 0's parameters and buffers, and marks the model's
LocalHeads (and `FusedSGDEmbeddings`) with the process group. Inside `Scheduler.step()`, after
segment k's backward, the scheduler all-reduces (sum, then / world size) the gradients that
segment completes -- its blocks' and its head's, in one flat buffer per dtype, on the stream the
backward ran on -- so the collective runs while segment k+1 computes its forward. Which segment
completes which parameter (the last one reaching it) is learned from the previous step, as for
early updates; the first step, and any parameter the plan does not place, is reduced after the
final head's backward. Every rank issues the same collectives in the same order: the plan comes
from the segment order, which adaptive forking and streams do not change. An early update of a
segment runs after its all-reduce, on the same stream.

Why not one `DistributedDataParallel` around the model: DDP's reducer ignores gradient hooks until
its own forward returns, and ERASE back-propagates inside the forward (silently different
gradients per rank, then a crash). One DDP per segment body works, but changes the modules and
their state_dict keys and needs a second mechanism for the heads, whose gradients the fused
kernel writes directly; the scheduler already knows each segment's leaves, so it issues the
collectives itself. Gradients equal the single-process gradients of the union batch when every
rank has the same number of rows (as with DDP). docs/api.md#many-gpus has the details.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .scheduler.collectives import DataParallelGroup, all_reduce_grads, gather_rows

__all__ = ["DataParallelGroup", "all_reduce_grads", "data_parallel", "gather_rows", "launch_from_env", "local_only",
           "param_groups", "shard_of"]


# a model prepared to run rank-local in a distributed job (no gradient averaging)
LOCAL = DataParallelGroup(None, 1, 0, local=True)


def _check_initialized(what: str):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs torch.distributed to be initialized: call "
                           "torch.distributed.init_process_group(...) first (torchrun sets its environment)")


def _heads(model):
    from .head import LocalHead

    return [m for m in model.modules() if isinstance(m, LocalHead)]


def _refuse_wrappers(model):
    """A whole-model DDP or FSDP root cannot run ERASE's in-forward backwards."""
    from torch.nn.parallel import DistributedDataParallel

    for name, m in model.named_modules():
        if isinstance(m, DistributedDataParallel):
            raise ValueError(f"model{'.' + name if name else ''} is a DistributedDataParallel: erase_triton's heads "
                             "back-propagate inside the forward, which DDP's reducer ignores. Pass the plain module "
                             "to erase_triton.distributed.data_parallel instead")
        if type(m).__name__.startswith("FSDP") and _heads(m):
            raise ValueError(f"model{'.' + name if name else ''} is sharded by FSDP (fully_shard): a root over the "
                             "whole chain re-runs post-backward after every segment. Pass the plain module to "
                             "erase_triton.distributed.data_parallel instead")


def _refuse_sparse(model):
    """Sparse gradients (an embedding with sparse=True) would reach the flat all-reduce mid-step."""
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            raise ValueError(f"model.{name} ({type(m).__name__}) has sparse=True: data_parallel averages dense "
                             "gradients only. Use sparse=False, or erase_triton.models.embedding.FusedSGDEmbeddings (SGD "
                             "applied in the backward to the rows every rank touched)")


def data_parallel(model: torch.nn.Module, process_group=None, *, shard: bool = False,
                  broadcast: bool = True) -> torch.nn.Module:
    """Make `model` train data-parallel over `process_group` (default: the world) in every
    scheduler mode, with early updates and under `Scheduler.capture`; returns the same object.

    shard: FSDP2 (`fully_shard`) for every segment body (`erase_triton.blocks.segment_bodies`), each
    its own root with `reshard_after_forward=False` (its backward follows its forward at once): the
    body's parameters are sharded and its gradients reduce-scattered by FSDP when its backward ends;
    the heads' gradients (and any parameter outside a body) are still averaged by the scheduler.
    For models too large to replicate; eager steps only (`Scheduler.capture` raises). Tested with gloo;
    not yet run with NCCL (docs/api.md#many-gpus). Bodies holding a `FusedSGDEmbeddings` stay replicated. Build
    the optimizer over `param_groups(model)`: a foreach optimizer step (the default on CUDA) cannot
    take sharded and replicated parameters in one group.
    broadcast: copy rank 0's parameters and buffers to every rank now (as DDP does), before sharding.
    Raises if the model has no LocalHead, is already wrapped in DDP / FSDP, or has an embedding with
    sparse gradients (sparse=True).
    """
    from .models.embedding import FusedSGDEmbeddings

    _check_initialized("data_parallel")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _refuse_wrappers(model)
    heads = _heads(model)
    if not heads:
        raise ValueError("model has no LocalHead: data_parallel is for ERASE models; wrap other models in "
                         "torch.nn.parallel.DistributedDataParallel")
    if not isinstance(shard, bool):
        raise TypeError(f"shard must be a bool, got {shard!r}")
    _refuse_sparse(model)
    if dist.get_backend(process_group) == "nccl":  # NCCL takes CUDA tensors only (the broadcast, every all-reduce)
        off = next(((n, t.device) for n, t in list(model.named_parameters()) + list(model.named_buffers())
                    if not t.is_cuda), None)
        if off is not None:
            raise ValueError(f"model.{off[0]} is on {off[1]} but the process group is NCCL: move the model to this "
                             "rank's GPU before data_parallel, e.g. model.to(f'cuda:{local_rank}')")
    world = dist.get_world_size(process_group)
    fused = [m for m in model.modules() if isinstance(m, FusedSGDEmbeddings)]
    if broadcast and world > 1:
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src, group=process_group)
    if shard:
        _shard_bodies(model, process_group)
    skip = {id(m.weight) for m in fused}
    # parameters FSDP manages (DTensors: sharded here or by the caller) have their gradients reduced by FSDP
    params = tuple(p for p in model.parameters() if p.requires_grad and id(p) not in skip and not isinstance(p, DTensor))
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    dp = DataParallelGroup(process_group, world, dist.get_rank(process_group), params, sharded=sharded)
    for h in heads:
        h.data_parallel = dp
    for m in fused:
        m.data_parallel = dp
    return model


def _shard_bodies(model, process_group):
    """fully_shard every segment body (not those holding fused-SGD tables)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from .blocks import segment_bodies
    from .models.embedding import FusedSGDEmbeddings

    first = next(model.parameters())
    mesh = DeviceMesh.from_group(process_group if process_group is not None else dist.group.WORLD,
                                 first.device.type)
    for _, body in segment_bodies(model):
        if not any(isinstance(m, FusedSGDEmbeddings) for m in body.modules()):
            fully_shard(body, mesh=mesh, reshard_after_forward=False)


def param_groups(model: torch.nn.Module) -> list[dict]:
    """The model's parameters as optimizer groups, the ones `data_parallel(shard=True)` sharded (DTensors)
    apart from the rest: ``torch.optim.SGD(param_groups(model), lr=...)``. An optimizer's foreach step (the
    default on CUDA) runs one group at a time and raises on a group that mixes DTensors and tensors."""
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    return [{"params": ps} for ps in (sharded, plain) if ps]


def local_only(model: torch.nn.Module) -> torch.nn.Module:
    """Mark `model` as rank-local in a distributed job (no gradient averaging): its LocalHeads
    then run without the data-parallel check. Returns the same object."""
    for h in _heads(model):
        h.data_parallel = LOCAL
    return model


def shard_of(n: int, rank: int, world: int) -> slice:
    """Rank `rank`'s contiguous share of n rows (the first n % world ranks get one more)."""
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    return slice(start, start + per + (rank < extra))


@dataclasses.dataclass
class Launch:
    """What `launch_from_env` set up for this process under torchrun."""

    rank: int
    world_size: int
    device: str

    def close(self, barrier: bool = True):
        """Tear the process group down once every rank is done with it (a rank that destroys it while
        another still runs a collective can abort both at exit). barrier=False after an error: the
        other ranks may never arrive."""
        if dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()


def launch_from_env(device: str | None = None) -> Launch | None:
    """Under torchrun (WORLD_SIZE in the environment): init the default process group (NCCL
    on CUDA, gloo on CPU), pick this rank's device (cuda:LOCAL_RANK), and return a `Launch`;
    otherwise None."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("erase-triton: error: --device cuda given but no CUDA device is visible")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        if local >= torch.cuda.device_count():
            raise SystemExit(f"erase-triton: error: LOCAL_RANK {local} but only {torch.cuda.device_count()} "
                             "CUDA devices are visible")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Launch(dist.get_rank(), dist.get_world_size(), f"cuda:{local}" if cuda else "cpu")
