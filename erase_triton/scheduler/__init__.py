"""The scheduler: the same model code in three modes, early backward on a stream ring.

``plan`` decides (pure, CPU-tested); ``executor`` carries the decisions out with CUDA
streams, events and graphs. See `Scheduler` and docs/api.md.
"""
from ..context import current
from .executor import MODES, CapturedStep, Scheduler, StepState
from .plan import DetachPlan, RingPlan, UpdatePlan, plan_detach_point

__all__ = ["CapturedStep", "DetachPlan", "MODES", "RingPlan", "Scheduler", "StepState", "UpdatePlan", "current",
           "plan_detach_point"]
