"""`LocalHead`: a detach point with a fused local loss.

Call it where a block ends: ``h = head(h, target)``. In training it computes the
head's loss and all its gradients in one fused launch on ``h.detach()``, adds
grad_weight/grad_bias into the parameters' ``.grad``, back-propagates grad_h into
the block that produced ``h`` at once, and returns ``h.detach()`` for the next
block. Under an active `Scheduler` the mode decides ("e2e" turns non-final heads
into identities; "erase" moves the backward onto the segment's stream).

Each head is a ``torch.compile`` boundary (``torch.compiler.disable``). To compile the blocks
between heads use `erase_triton.compile_blocks(model)`: a whole-model ``model.compile()`` gets no
compiled kernels here (every head is a graph break, and Dynamo runs a frame that breaks inside a
loop uncompiled).

``activation="relu"`` takes over the block's last ReLU: the block ends at the
pre-activation x, the head returns relu(x) for the next block and computes its loss
on relu(x), and the fused kernel writes the gradient at x directly (zero where
x <= 0), so the ReLU's own backward pass never runs. relu(x) itself is a separate
launch only for a head beside the next segment (`early_act`); otherwise the head's
kernel writes it as it reads x.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from erase_triton.kernels.launch import LaunchConfig, check_occupancy
from erase_triton.kernels.plan import SMALL_CE_MAX_C

from . import context

from .functional import (check_activation, check_args, check_backend, check_classes, check_options, local_head_into,
                         use_triton)
from .reference import linear_head_loss

__all__ = ["LocalHead", "DEFAULT_OCCUPANCY", "WHOLE_DEVICE_MIN_ELEMENTS"]

# SM fraction of an "auto" head beside the next forward: the occupancy sweep's best (docs/tuning.md#side-head-occupancy)
DEFAULT_OCCUPANCY = 0.125
# ...and the whole device from this many elements of h, where the next GEMMs fill it anyway (same section)
WHOLE_DEVICE_MIN_ELEMENTS = 1 << 25


_AUTO_BESIDE = LaunchConfig(DEFAULT_OCCUPANCY)  # occupancy="auto" beside the next segment (the size rule applies)


def _distributed_world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class LocalHead(nn.Module):
    """Linear(in_features, out_features) + loss, fused, at a detach point.

    loss: "bce" (1..64 sigmoid labels), "ce" (2..131072 classes), "mse".
    final=True marks the model's top head: active in every mode, and in "e2e" the
    only active head, whose gradient then flows through the whole model.
    occupancy: fraction of SMs for the fused kernel's persistent grid. "auto" (default):
    DEFAULT_OCCUPANCY (1/8, the sweep's best) when the head runs beside the next segment
    (erase mode on CUDA streams) and h has fewer than WHOLE_DEVICE_MIN_ELEMENTS elements, the
    whole device otherwise and for every CE head of more than 512 classes (a vocabulary head:
    7-9x slower at 1/8 of the SMs). None: always the whole device.
    activation: None, or "relu": the head applies the block's last ReLU itself (it receives
    the pre-activation, returns its ReLU) and the fused kernel back-propagates through it,
    saving the ReLU's backward pass; backend="torch" runs a plain F.relu under autograd.

    Launch settings (public, settable between steps): `config`, the `LaunchConfig` of a head
    nothing runs beside (sequential, e2e, the final head), and `beside_config`, the one of a head
    beside the next segment (erase on CUDA streams; with occupancy="auto" the size rule of
    `launch_config` applies to it until it is replaced). `configure(**fields)` changes other
    LaunchConfig fields in both and keeps the occupancy rule, e.g.
    ``head.configure(vocab_path="row_chunks")`` for a vocabulary head (whose default path is
    `kernels.plan.vocab_path_for`'s).
    """

    _torch_loss = staticmethod(linear_head_loss)  # the PyTorch path's loss (a subclass may compile it)
    data_parallel = None  # set by erase_triton.distributed.data_parallel (or local_only)

    def __init__(self, in_features: int, out_features: int = 1, loss: str = "bce", *, bias: bool = True,
                 occupancy: float | str | None = "auto", final: bool = False, reduction: str = "mean",
                 ignore_index: int = -100, backend: str = "auto", config: LaunchConfig | None = None,
                 activation: str | None = None, device=None, dtype=None):
        super().__init__()
        check_activation(activation)
        self.activation = activation
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_options(loss, reduction, ignore_index)
        check_classes(loss, out_features, "out_features")
        for name, v in (("bias", bias), ("final", final)):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, got {v!r}")
        check_backend(backend)
        if config is not None and not isinstance(config, LaunchConfig):
            raise TypeError(f"config must be a LaunchConfig or None, got {type(config).__name__}")
        check_occupancy(occupancy, allow_auto=True)
        self.in_features, self.out_features, self.loss = in_features, out_features, loss
        self.final, self.reduction, self.ignore_index, self.backend = final, reduction, ignore_index, backend
        if config is not None and occupancy not in (None, "auto"):
            raise ValueError("pass either occupancy or config, not both")
        self.auto_occupancy = config is None and occupancy == "auto"
        self.config = config if config is not None else LaunchConfig(None if self.auto_occupancy else occupancy)
        self.beside_config = _AUTO_BESIDE if self.auto_occupancy else self.config
        self._auto_beside = self.beside_config if self.auto_occupancy else None  # the object that means "auto"
        self._vocabulary = loss == "ce" and out_features > SMALL_CE_MAX_C
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        self.reset_parameters()
        self.last_loss: torch.Tensor | None = None

    def reset_parameters(self):
        # nn.Linear's initialisation, so a swap-in replacement trains the same.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        occ = "auto" if self.auto_occupancy else self.config.occupancy
        return (f"in_features={self.in_features}, out_features={self.out_features}, loss={self.loss!r}, "
                f"bias={self.bias is not None}, final={self.final}, occupancy={occ}"
                + (f", activation={self.activation!r}" if self.activation else ""))

    def launch_config(self, h: torch.Tensor, beside: bool) -> LaunchConfig:
        """The kernel's LaunchConfig for input h; beside: the next segment runs concurrently."""
        if not beside:
            return self.config
        if self.beside_config is self._auto_beside and (h.numel() >= WHOLE_DEVICE_MIN_ELEMENTS or self._vocabulary):
            # "auto" on a large input, or a vocabulary head (7-9x slower at 1/8 of the SMs): the whole device
            return self.config
        return self.beside_config

    def configure(self, **fields) -> "LocalHead":
        """Set `LaunchConfig` fields other than occupancy (e.g. ``vocab_path``, ``chunk_size``,
        ``deterministic``, tiles) in both launch settings, keeping the occupancy rule: a head built
        with occupancy="auto" stays "auto". Returns the head."""
        names = {f.name for f in dataclasses.fields(LaunchConfig)} - {"occupancy"}
        bad = sorted(set(fields) - names)
        if bad:
            raise ValueError(f"configure() takes LaunchConfig fields other than occupancy ({', '.join(sorted(names))}), "
                             f"got {', '.join(bad)}")
        auto = self.beside_config is self._auto_beside
        self.config = dataclasses.replace(self.config, **fields)
        self.beside_config = dataclasses.replace(self.beside_config, **fields)
        if auto:
            self._auto_beside = self.beside_config
        return self

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """The head's activation as a plain autograd op (identity without one)."""
        return F.relu(h) if self.activation == "relu" else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Plain forward of the head (for evaluation and prediction); h is the activated input."""
        return F.linear(h, self.weight, self.bias)

    # A torch.compile boundary: `model.compile()` compiles the blocks between detach points and
    # runs the heads, the stream switches and the early backwards in Python, as uncompiled. Traced,
    # the scheduler's stream calls and backward() would break the graph anyway, and its per-head
    # state (ids, segment counts) would recompile the frame at every head.
    @torch.compiler.disable
    def forward(self, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return self.act(h)
        sched = context.current()
        if self.data_parallel is None and _distributed_world() > 1:
            raise RuntimeError(
                "LocalHead in a distributed run (world size > 1) on a model not prepared by "
                "erase_triton.distributed.data_parallel(model): a whole-model DistributedDataParallel or "
                "fully_shard gives each rank different gradients with ERASE. Call data_parallel(model) on the "
                "plain model (or erase_triton.distributed.local_only(model) for a rank-local model)")
        if sched is None and self.data_parallel is not None and not self.data_parallel.local:
            raise RuntimeError("a data-parallel LocalHead runs inside Scheduler.step() (the scheduler issues "
                               "each segment's gradient all-reduce); wrap the training step in `with sched.step():`")
        mode = sched.mode if sched is not None else "sequential"
        if mode == "e2e" and not self.final:
            if sched is not None:
                sched.identity_head()  # a step that meets only these trains nothing: the scheduler says so
            return self.act(h)
        if self.activation is not None and not use_triton(h, self.backend):
            h = self.act(h)  # PyTorch heads: the ReLU as an autograd op
        if sched is not None:
            return sched.detach_point(self, h, target)
        return self.apply_loss(h, target)

    def early_act(self, h: torch.Tensor) -> torch.Tensor | None:
        """relu(h) as its own launch, for a fused head with activation="relu" whose next segment
        runs beside it: the scheduler queues it before the detach point's event, so the next
        segment does not wait for the head's kernel. None for any other head."""
        if self.activation is not None and use_triton(h, self.backend):
            return torch.relu(h.detach())
        return None

    def apply_loss(self, h: torch.Tensor, target: torch.Tensor, beside: bool = False,
                   act: torch.Tensor | None = None) -> torch.Tensor:
        """Fused loss + grads on the current stream; backward into h's producer; returns what the
        next block reads: h.detach(), or relu(h) with activation="relu".
        beside=True: the scheduler runs the next segment concurrently (occupancy "auto" shrinks the
        grid, for inputs below WHOLE_DEVICE_MIN_ELEMENTS: `launch_config`).
        act: relu(h) already computed (`early_act`, for a head beside the next segment): the
        kernel reads it, the gradient goes to h through the ReLU, and act is returned. Without
        it a fused head with activation="relu" reads h and its kernel writes relu(h) as it goes
        (dense and small CE kernels): no separate ReLU launch ahead of a head nothing runs beside."""
        if not use_triton(h, self.backend):
            check_args(h, self.weight, self.bias, target, self.loss, self.reduction, self.ignore_index)
            # What a PyTorch user writes: one autograd call through head and block.
            loss = self._torch_loss(h, self.weight, self.bias, target, self.loss, self.reduction, self.ignore_index)
            loss.backward()
            self.last_loss = loss.detach().float()
            return h.detach()
        w, b = self.weight, self.bias
        if w.grad is not None and not w.grad.is_contiguous():
            w.grad = w.grad.contiguous()  # the kernel adds into a contiguous [C, D]
        acc_w = w.grad is not None
        gw = w.grad if acc_w else torch.empty_like(w, memory_format=torch.contiguous_format)
        gb = None
        acc_b = False
        if b is not None:
            acc_b = b.grad is not None
            gb = b.grad if acc_b else torch.empty_like(b)
        if acc_w != acc_b and b is not None:
            # Mixed state (one .grad set, one None): keep each exact by materialising the other.
            if not acc_w:
                gw.zero_()
            else:
                gb.zero_()
            acc_w = acc_b = True
        hd = h.detach() if act is None else act
        out = hd
        if act is None and self.activation is not None:
            out = torch.empty_like(hd, memory_format=torch.contiguous_format)  # relu(h), from the kernel
        loss, grad_h = local_head_into(hd, w.detach(), b.detach() if b is not None else None, target,
                                       loss=self.loss, reduction=self.reduction, ignore_index=self.ignore_index,
                                       backend=self.backend, config=self.launch_config(hd, beside),
                                       grad_weight=gw, grad_bias=gb, accumulate=acc_w,
                                       activation=self.activation, act_out=None if out is hd else out)
        if w.grad is None and w.requires_grad:  # a frozen head keeps .grad None
            w.grad = gw
        if b is not None and b.grad is None and b.requires_grad:
            b.grad = gb
        self.last_loss = loss
        if h.requires_grad:
            torch.autograd.backward(h, grad_h)
        return out
