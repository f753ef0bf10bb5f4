"""erase_triton: early backpropagation (ERASE) with fused Triton local heads.

Public API (see README.md):
    fused_local_head, LocalHeadResult, LaunchConfig  -- one-launch head loss + grads
    LocalHead                                         -- nn.Module detach point
    LocalChain                                        -- your blocks with a LocalHead after every k-th
    Scheduler                                         -- e2e / sequential / erase on CUDA streams
    compile_blocks                                    -- torch.compile the blocks between heads
    erase_triton.distributed.data_parallel            -- many GPUs: per-segment gradient all-reduce
    erase_triton.bench                                -- the runner behind `erase-triton bench|sweep|trace|plot`
Semantics and guarantees: docs/api.md.
"""
from erase_triton.kernels.launch import LaunchConfig

from . import reference
from .blocks import compile_blocks
from .chain import LocalChain
from .functional import LocalHeadResult, fused_local_head
from .head import LocalHead
from .scheduler import Scheduler

__all__ = ["LaunchConfig", "LocalChain", "LocalHead", "LocalHeadResult", "Scheduler", "compile_blocks", "fused_local_head", "reference"]
__version__ = "0.1.0"
