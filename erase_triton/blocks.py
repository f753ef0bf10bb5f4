"""`compile_blocks`: torch.compile the blocks between a model's detach points.

Compiling a whole model with LocalHeads in a loop does not work: every head is a graph break
(it switches streams and runs a backward), and Dynamo skips a frame that breaks inside a loop,
so the model runs uncompiled (at best its user-defined blocks get compiled one by one, by
accident). Compiling each block instead keeps the schedule in Python and gives every block a
compiled forward and a compiled backward (AOTAutograd), which the scheduler runs on the block's
segment stream like any other autograd node; `Scheduler.capture` records the compiled kernels
into the step's graph.

    compile_blocks(model)              # default Inductor; kwargs go to torch.compile
    sched = Scheduler("erase")
    replay = sched.capture(step, *inputs)
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn

from .head import LocalHead

__all__ = ["compile_blocks", "segment_bodies"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _has_head(m: nn.Module) -> bool:
    return any(isinstance(s, LocalHead) for s in m.modules())


def _module_call(module: nn.Module, *args, **kwargs):
    """A module's call as a frame Dynamo compiles. `nn.Module.compile` compiles `_call_impl`, a
    torch.nn frame that Dynamo skips: a block that is a torch.nn module (an nn.Sequential) would
    stay uncompiled."""
    return module._call_impl(*args, **kwargs)


def _fresh_module_call():
    """`_module_call` with a code object of its own. Dynamo keeps its compiled graphs, and counts
    recompiles against recompile_limit, per code object: one a compile_blocks call makes the
    blocks of one model share graphs and a limit, and keeps other models' out of both."""
    return types.FunctionType(_module_call.__code__.replace(), _module_call.__globals__, "_module_call")


def segment_bodies(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every largest submodule of `model` that holds no LocalHead and has
    parameters, in `named_modules` order: the blocks between detach points (a ModuleList or
    ModuleDict is not callable: its members are taken instead). What `compile_blocks` compiles
    and `data_parallel(shard=True)` shards."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    done: set[int] = set()
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, m: nn.Module):
        if id(m) in done or isinstance(m, LocalHead):
            return
        done.add(id(m))
        if isinstance(m, _CONTAINERS) or _has_head(m):
            for child_name, child in m.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
        elif any(True for _ in m.parameters()):
            out.append((name, m))
    visit("", model)
    return out


def compile_blocks(model: nn.Module, **compile_kwargs) -> list[str]:
    """Compile, in place, every largest submodule of `model` that holds no LocalHead and has
    parameters: the blocks between detach points (a ModuleList or ModuleDict is not callable:
    its members are compiled instead). The heads stay uncompiled (`LocalHead.forward` is a
    compile boundary). Returns the compiled modules' names, in `named_modules` order ("" for the
    model itself when it holds no head). The modules, their names and state_dict keys stay as
    they were: each compiled module's call goes through torch.compile, as after `module.compile()`.

    compile_kwargs: passed to torch.compile (backend, mode, ...); dynamic defaults to False
    (static shapes, what a captured step replays; a new batch shape compiles anew). Blocks of one
    type and shape share a graph; a model whose blocks have more distinct (type, shape)
    signatures than torch._dynamo.config.recompile_limit (8) runs the rest uncompiled, with
    Dynamo's warning (the count is per compile_blocks call: other models compiled by other calls
    do not add to it). mode="reduce-overhead" would capture each block in a CUDA graph of its own;
    capture the whole step with `Scheduler.capture` instead."""
    bodies = segment_bodies(model)
    compile_kwargs.setdefault("dynamic", False)
    call = torch.compile(_fresh_module_call(), **compile_kwargs)
    for _, m in bodies:
        m._compiled_call_impl = functools.partial(call, m)  # what nn.Module.compile sets
    return [name for name, _ in bodies]
