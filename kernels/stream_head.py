"""`stream_head`: a measuring stick for the schedule benchmarks, not a head.

It moves the bytes a fused C=1 dense head moves (reads h, writes grad_h, and relu(h) with
`act_out`) on the same tiles, grid and occupancy as `_dense_head_kernel`, and writes the same
gradient, grad_h = dz w (zero where h <= 0 with relu=True), from a dz it is *given*. What it
leaves out is what makes a head a head: the logits' row reduction between loading a row and
storing its gradient, the loss, and grad_W / grad_b / the loss summed over the grid (it keeps
the per-program grad_W partial in registers and stores it, unsummed, to `part`).

A schedule whose heads are stream heads (`erase_triton.study.StreamHead`) therefore shows what
a head costs the step through its bytes and its grid alone: fused heads against stream heads
is what the kernel's compute structure costs; stream heads against zero-cost heads
(`FreeHead`) is the cost of the I/O every correct head must do, at this occupancy and tiling.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig, next_pow2, num_programs
from .local_head import _dense_blocks, _relu_in, _relu_out

__all__ = ["stream_head"]


@triton.jit(do_not_specialize=["N", "n_tiles"])
def _stream_head_kernel(h_ptr, dz_ptr, w_ptr, gh_ptr, act_ptr, part_ptr, N, D, stride_h, n_tiles,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
                        RELU: tl.constexpr, STORE_ACT: tl.constexpr):
    pid = tl.program_id(0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_w = tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # the dense kernel's static split: program p takes row tiles p, p + P, ...
    for t in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
        m_n = o_n < N
        m = m_n[:, None] & m_d[None, :]
        b_h = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d[None, :], mask=m, other=0.0), RELU)
        if STORE_ACT:
            tl.store(act_ptr + o_n[:, None] * D + o_d[None, :], b_h, mask=m)
        b_dz = tl.load(dz_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_gh = b_dz[:, None] * b_w[None, :]
        tl.store(gh_ptr + o_n[:, None] * D + o_d[None, :], _relu_out(b_gh, b_h, RELU).to(gh_ptr.dtype.element_ty),
                 mask=m)
        b_acc += tl.sum(b_dz[:, None] * b_h.to(tl.float32), axis=0)
    tl.store(part_ptr + pid * BLOCK_D + o_d, b_acc, mask=m_d)


def stream_head(h: torch.Tensor, dz: torch.Tensor, weight: torch.Tensor, *, relu: bool = False,
                act_out: torch.Tensor | None = None, config: LaunchConfig = LaunchConfig()) -> torch.Tensor:
    """grad_h = dz[:, None] * weight (masked where h <= 0 if relu) for h [N, D] (unit stride on D),
    dz [N] float, weight [1, D]; act_out (relu only): a contiguous tensor like h that receives
    relu(h). The dense head's tile rule and grid for `config` (deterministic=False: its atomic,
    statically split mode). Returns grad_h, contiguous, h's dtype."""
    if h.dim() != 2 or h.stride(1) != 1:
        raise ValueError(f"h must be [N, D] with unit stride on D, got shape {tuple(h.shape)} strides {h.stride()}")
    N, D = h.shape
    if tuple(weight.shape) != (1, D):
        raise ValueError(f"weight must be [1, {D}] (a C=1 head), got {tuple(weight.shape)}")
    if tuple(dz.shape) != (N,) or not dz.is_floating_point():
        raise ValueError(f"dz must be a floating tensor [{N}], got {tuple(dz.shape)} {dz.dtype}")
    if act_out is not None and (not relu or act_out.shape != h.shape or not act_out.is_contiguous()):
        raise ValueError("act_out needs relu=True and a contiguous tensor shaped like h")
    cuda = h.is_cuda
    blk = _dense_blocks(D, 1, config, cuda, False, h.element_size())
    bn, bd, stages, warps = blk["BLOCK_N"], blk["BLOCK_D"], blk["NUM_STAGES"], blk["num_warps"]
    if bd < D:
        raise ValueError(f"stream_head covers whole-row tiles only (D <= {next_pow2(bd)}), got D={D}")
    grad_h = torch.empty_like(h)
    n_tiles = -(-N // bn)
    cx = dict(BLOCK_N=bn, BLOCK_D=bd, NUM_STAGES=stages, RELU=relu, STORE_ACT=act_out is not None)
    part_like = torch.empty(1, dtype=torch.float32, device=h.device)

    def warmup():
        return _stream_head_kernel.warmup(h, dz, weight, grad_h, grad_h, part_like, N, D, h.stride(0), n_tiles,
                                          grid=(1,), num_warps=warps, **cx)
    P = min(n_tiles, num_programs(_stream_head_kernel, (h.dtype, tuple(cx.items()), warps), warmup, h.device, warps,
                                  config.occupancy, config.programs_per_sm))
    part = torch.empty(P * bd, dtype=torch.float32, device=h.device)
    act = act_out if act_out is not None else grad_h
    _stream_head_kernel[(P,)](h, dz, weight, grad_h, act, part, N, D, h.stride(0), n_tiles, num_warps=warps, **cx)
    return grad_h
