"""CUDA graphs of whole training steps: `capture` (what `Scheduler.capture` runs) and `CapturedStep`."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["CapturedStep", "capture"]


def capture(sched, step_fn, *static_inputs, warmup: int = 3) -> "CapturedStep":
    """Capture ``with sched.step(): step_fn(*static_inputs)`` in one CUDA graph.

    Runs `warmup` real steps first (they train: optimizer state and lazy
    allocations must exist before capture; at least 2 in "erase" mode with
    priorities="tail", whose second step gives the ring streams their final
    priorities; they fork at every detach point, like the captured step), then
    captures one step, including
    every early backward on its stream and whatever optimizer step step_fn does (or the
    scheduler's early updates); that optimizer must be capturable (SGD is; Adam and AdamW
    need capturable=True, and PyTorch raises at capture otherwise).
    Inside an enclosing ``torch.autocast("cuda")``, the warm-up and capture run with autocast's
    cast cache off, so every cast of an fp32 weight is a kernel in the graph and replays see
    the optimizer's in-place updates (with the cache on, the graph would read the warm-up's casts).
    Returns a callable that replays the graph and returns step_fn's output
    (static tensors, overwritten by each replay). Copy new data into
    static_inputs before each replay. step_fn may open ``with sched.step():`` itself (an eager
    step reused as is): that is the step capture opened, not a second one.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be a positive int, got {warmup!r}")
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
    if not torch.cuda.is_available():
        raise RuntimeError("Scheduler.capture needs CUDA")
    if sched.priorities == "tail" and sched.mode == "erase":
        warmup = max(warmup, 2)  # the second step re-creates the streams at their final priorities
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # The warm-up steps take the captured step's path (every detach point forks), so what
    # a ring stream allocates on first use (the heads' per-stream workspaces, zeroed once)
    # exists before capture; allocated during capture, its zero-fill would be recorded
    # and replayed before every head (two fill kernels a head on the H200 trace).
    sched._warming = sched._capture_owns_step = True
    try:
        with torch.cuda.stream(side), _autocast_cache_off():
            for _ in range(warmup):
                with sched.step():
                    step_fn(*static_inputs)
    finally:
        sched._warming = sched._capture_owns_step = False
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    sched._capture_owns_step = True
    try:
        with _autocast_cache_off(), torch.cuda.graph(graph, stream=side):
            with sched.step():
                out = step_fn(*static_inputs)
    finally:
        sched._capture_owns_step = False
    return CapturedStep(graph, out)


def _autocast_cache_off(device: str = "cuda"):
    """Inside an enclosing torch.autocast(device), the same autocast with its cast cache off; else nothing.

    Autocast caches the low-precision copy of each fp32 leaf parameter until the outermost autocast
    exits, and does not watch the parameter's version. Captured inside one autocast region after the
    warm-up steps filled that cache, a graph would read the warm-up's copies: never re-cast, so its
    replays would not see an optimizer's in-place updates of the fp32 weights (and the copies are freed
    when the region ends, while the graph still reads them). With the cache off, every cast is a kernel
    in the graph, run on each replay. (Why `make_graphed_callables` refuses autocast's cache.)
    """
    if not (torch.is_autocast_enabled(device) and torch.is_autocast_cache_enabled()):
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False)


class CapturedStep:
    """A captured training step: call it to replay."""

    def __init__(self, graph, out):
        self.graph, self.out = graph, out

    def __call__(self):
        self.graph.replay()
        return self.out
