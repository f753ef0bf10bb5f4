"""Heads that bound or replace the fused head in the schedule studies: zero-cost heads
(`FreeHead`, the bound no head implementation can beat) and compiled PyTorch heads
(`CompiledTorchHead`, the strongest head a PyTorch user would write). `with_heads` builds a
workload with any of them."""
from __future__ import annotations

import functools

import torch

from .. import reference
from ..head import LocalHead
from ..reference import linear_head_loss

__all__ = ["CompiledTorchHead", "FreeHead", "HEADS", "free_heads", "set_vocab_path", "swap_heads", "with_heads"]


class FreeHead(LocalHead):
    """The bound on what any head implementation can buy: a head that costs nothing. It
    back-propagates a stored gradient into its block (no logits, no loss, no head grads), so a
    step with FreeHeads is the step's time with the heads' work removed. With
    activation="relu" its gradient goes to the ReLU's input, as the fused head's does, and it
    returns relu(h) from its own launch (queued before the backward).

    free_grad: "constant" (1e-4 everywhere) or "replayed" (the
    gradient a real head computed on the first call, with PyTorch, reused on every later call).
    The block's backward GEMMs then multiply the same kind of data as with a real head: a
    constant feeds them few bit toggles, and a matrix unit on low-toggle data draws less power
    and can run faster (METHOD.md: a bf16 product 13% faster on zeros than on random data), so
    the constant bound can overstate what removing the heads buys where the step is GEMM-bound."""

    free_grad = "constant"

    def apply_loss(self, h, target, beside=False, act=None):
        out = act if act is not None else self.act(h.detach())
        g = getattr(self, "_free_grad", None)
        if g is None or g.shape != h.shape or g.dtype != h.dtype:
            if self.free_grad == "replayed":
                g = reference.local_head(h.detach(), self.weight, self.bias, target, loss=self.loss,
                                         reduction=self.reduction, ignore_index=self.ignore_index,
                                         activation=self.activation).grad_h
            else:
                g = torch.full_like(h, 1e-4)
            self._free_grad = g
        if h.requires_grad:
            torch.autograd.backward(h, g)
        return out


def swap_heads(model, cls, cached: str | None = None, **attrs):
    """Make every LocalHead of `model` a `cls` (in place), with attrs set and the cached replay
    state (`cached`, if any) dropped; returns the model."""
    for m in model.modules():
        if isinstance(m, LocalHead):
            m.__class__ = cls
            m.__dict__.update(attrs)
            if cached:
                m.__dict__.pop(cached, None)
    return model


def free_heads(model, free_grad: str = "constant"):
    """Make every LocalHead of `model` a FreeHead (in place) with the given free_grad; returns the model."""
    if free_grad not in ("constant", "replayed"):
        raise ValueError(f"free_grad must be 'constant' or 'replayed', got {free_grad!r}")
    return swap_heads(model, FreeHead, "_free_grad", free_grad=free_grad)


@functools.cache
def _compiled_torch_head_loss():
    return torch.compile(linear_head_loss, dynamic=False)


class CompiledTorchHead(LocalHead):
    """The strongest PyTorch head a user would write: the head's logits and loss under
    torch.compile (Inductor fuses the bias, the loss and the loss's backward around the GEMMs;
    the GEMMs stay cuBLAS), then one backward() through head and block, as a PyTorch head does.
    Build it with backend="torch" (`with_heads(..., "torch-compile")`): it is LocalHead's PyTorch
    path with `linear_head_loss` compiled, and a ReLU head's activation runs before it as for
    PyTorch heads. Graphs are shared by all such heads in the process: call torch._dynamo.reset()
    between models of other shapes (recompile_limit)."""

    @property
    def _torch_loss(self):
        return _compiled_torch_head_loss()


HEADS = ("fused", "torch", "torch-compile", "free", "free-replayed")


def with_heads(workload, heads: str, *args, **kw):
    """workload(*args, **kw) (e.g. `mlp_workload`) with fused ("fused"), PyTorch ("torch"),
    compiled PyTorch heads ("torch-compile": `CompiledTorchHead`) or zero-cost heads (`FreeHead`:
    "free" back-propagates a constant, "free-replayed" the first step's real head gradient);
    returns (model, inputs)."""
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")
    model, inputs = workload(*args, backend="torch" if heads.startswith("torch") else "auto", **kw)
    if heads == "torch-compile":
        swap_heads(model, CompiledTorchHead)
    elif heads.startswith("free"):
        free_heads(model, "replayed" if heads == "free-replayed" else "constant")
    return model, inputs


def set_vocab_path(model, path: str):
    """Every LocalHead of model takes this vocabulary CE path (`LaunchConfig.vocab_path`;
    `LocalHead.configure`, so an "auto" occupancy stays auto)."""
    for m in model.modules():
        if isinstance(m, LocalHead):
            m.configure(vocab_path=path)
    return model
