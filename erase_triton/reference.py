"""Pure-PyTorch reference of every kernel (runs in float64 when given float64).

`local_head` has the same signature and result as `erase_triton.fused_local_head`;
it is the `backend="torch"` path and the oracle of the tests.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

__all__ = ["LocalHeadResult", "linear_head_loss", "local_head"]


class LocalHeadResult(NamedTuple):
    loss: torch.Tensor                    # 0-dim fp32 (fp64 for fp64 inputs)
    grad_h: torch.Tensor                  # h's shape and dtype, contiguous
    grad_weight: torch.Tensor             # weight's shape and dtype
    grad_bias: Optional[torch.Tensor]     # bias's shape and dtype, or None


def head_loss(logits: torch.Tensor, target: torch.Tensor, loss: str, reduction: str, ignore_index: int):
    """Loss of [N, C] logits; the single definition shared by reference and models."""
    if loss == "bce":
        return F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), reduction=reduction)
    if loss == "mse":
        return F.mse_loss(logits, target.to(logits.dtype), reduction=reduction)
    return F.cross_entropy(logits, target.long(), ignore_index=ignore_index, reduction=reduction)


def linear_head_loss(h, weight, bias, target, loss: str, reduction: str, ignore_index: int) -> torch.Tensor:
    """A PyTorch head's loss, as a PyTorch user writes it (LocalHead's backend="torch"): Linear on h's
    rows in h's dtype (a weight of another dtype is used in h's dtype, as autocast's Linear would), then
    the loss on fp32 logits (a 16-bit loss loses the residuals: fp16 MSE overflows near 256)."""
    C = weight.shape[0]
    z = F.linear(h, weight.to(h.dtype), bias.to(h.dtype) if bias is not None else None).reshape(-1, C)
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()
    return head_loss(z, target.reshape(-1) if loss == "ce" else target.reshape(-1, C), loss, reduction, ignore_index)


def local_head(h, weight, bias, target, *, loss="bce", reduction="mean", occupancy=None,
               ignore_index=-100, backend="torch", activation=None) -> LocalHeadResult:
    """Linear head + loss + autograd, computed as the kernels compute: the operands in h's dtype (a
    weight of another dtype is rounded to h's dtype, as autocast's Linear would), every product and sum
    in fp32 (float64 for float64 inputs), the outputs rounded once to their dtypes (grad_h to h's, the
    parameter gradients to the parameters').
    activation="relu": the head reads relu(h), and grad_h is the gradient at h."""
    del occupancy, backend  # accepted for signature parity with fused_local_head
    D = h.shape[-1]
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    hh = h.detach().reshape(-1, D).to(acc).requires_grad_(True)
    w = weight.detach().to(h.dtype).to(acc).requires_grad_(True)
    b = bias.detach().to(h.dtype).to(acc).requires_grad_(True) if bias is not None else None
    out = linear_head_loss(F.relu(hh) if activation == "relu" else hh, w, b, target, loss, reduction, ignore_index)
    leaves = [hh, w] + ([b] if b is not None else [])
    grads = torch.autograd.grad(out, leaves)
    return LocalHeadResult(
        out.detach().to(acc),
        grads[0].reshape(h.shape).to(h.dtype).contiguous(),
        grads[1].to(weight.dtype),
        grads[2].to(bias.dtype) if b is not None else None,
    )
