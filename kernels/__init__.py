"""Triton kernels of erase_triton (installed as ``erase_triton.kernels``)."""
from .launch import LaunchConfig
from .local_head import LOSSES, MAX_DENSE_C, MAX_VOCAB, HeadLaunch, prepare_launch

__all__ = ["HeadLaunch", "LaunchConfig", "LOSSES", "MAX_DENSE_C", "MAX_VOCAB", "prepare_launch"]
