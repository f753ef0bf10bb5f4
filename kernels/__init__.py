"""Triton kernels of erase_triton (installed as ``erase_triton.kernels``).

One module per kernel family (``dense_head``, ``small_ce``, ``vocab_ce``), their shared
device helpers (``common``), the host-side plan and launch (``plan``) and the
occupancy-to-grid rule (``launch``). References: ``erase_triton.reference``.
"""
from .launch import LaunchConfig
from .plan import LOSSES, MAX_DENSE_C, MAX_VOCAB, HeadLaunch, prepare_launch

__all__ = ["HeadLaunch", "LaunchConfig", "LOSSES", "MAX_DENSE_C", "MAX_VOCAB", "prepare_launch"]
