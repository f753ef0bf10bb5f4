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

from .launch import LaunchConfig, num_programs
from .local_head import _dense_blocks, _last_out, _reduce_rows, _relu_in, _relu_out, _reset

__all__ = ["dissect_outputs", "stream_head"]

_ACC_COPIES = 4  # as the dense kernel's atomic mode


def _stride_g(D: int) -> int:
    # one accumulator copy: [grad_W (D) | grad_b | loss], padded to 16 floats
    return -(-(D + 2) // 16) * 16


def dissect_outputs(D: int, device, dtype=torch.float32) -> tuple:
    """The `outputs` of `stream_head(dissect=)` for a C=1 head of width D: grad_w [1, D] and grad_b
    [1] in dtype, loss [1] fp32, and the zeroed accumulator copies and counters the atomic tail needs."""
    return (torch.empty(1, D, device=device, dtype=dtype), torch.empty(1, device=device, dtype=dtype),
            torch.empty(1, device=device), torch.zeros(_ACC_COPIES * _stride_g(D), device=device),
            torch.zeros(16, dtype=torch.int32, device=device))


@triton.jit(do_not_specialize=["N", "n_tiles"])
def _stream_head_kernel(h_ptr, dz_ptr, w_ptr, gh_ptr, act_ptr, part_ptr, y_ptr, b_ptr, gw_ptr, gb_ptr, loss_ptr,
                        acc_ptr, ctr_ptr, N, D, stride_h, n_tiles, scale, stride_g,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
                        RELU: tl.constexpr, STORE_ACT: tl.constexpr, COMPUTE_DZ: tl.constexpr,
                        ATOMIC_TAIL: tl.constexpr, ACC_COPIES: tl.constexpr, BLOCK_R: tl.constexpr):
    # COMPUTE_DZ / ATOMIC_TAIL put back, one at a time, what the fused kernel's C=1 BCE path adds
    # (the logits' row reduction, dz and the loss; the float atomics into ACC_COPIES accumulators and
    # the last program's sum): a dissection of the fused head's time, not a second head.
    pid = tl.program_id(0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_w = tl.load(w_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    b_loss = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_gb = tl.zeros([BLOCK_N], dtype=tl.float32)
    # the dense kernel's static split: program p takes row tiles p, p + P, ...
    for t in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=NUM_STAGES):
        o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
        m_n = o_n < N
        m = m_n[:, None] & m_d[None, :]
        b_h = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d[None, :], mask=m, other=0.0), RELU)
        if STORE_ACT:
            tl.store(act_ptr + o_n[:, None] * D + o_d[None, :], b_h, mask=m)
        if COMPUTE_DZ > 0:  # BCE, as the fused kernel computes it
            b_z = tl.sum(b_h.to(tl.float32) * b_w[None, :], axis=1) + tl.load(b_ptr).to(tl.float32)
            b_y = tl.load(y_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_loss += tl.where(m_n, tl.maximum(b_z, 0.0) - b_z * b_y + tl.log(1.0 + tl.exp(-tl.abs(b_z))), 0.0)
            b_dz = tl.where(m_n, (1.0 / (1.0 + tl.exp(-b_z)) - b_y) * scale, 0.0)
            b_gb += b_dz
            if COMPUTE_DZ == 2:  # h again (from L1 / L2) instead of holding the tile across the reduction
                b_h = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d[None, :], mask=m, other=0.0,
                                       cache_modifier=".ca"), RELU)
        else:
            b_dz = tl.load(dz_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_gh = b_dz[:, None] * b_w[None, :]
        tl.store(gh_ptr + o_n[:, None] * D + o_d[None, :], _relu_out(b_gh, b_h, RELU).to(gh_ptr.dtype.element_ty),
                 mask=m)
        b_acc += tl.sum(b_dz[:, None] * b_h.to(tl.float32), axis=0)
    if ATOMIC_TAIL > 0:  # 1: the atomics only; 2: and the last-out counter; 3: and the last program's sum
        p_acc = acc_ptr + (pid % ACC_COPIES) * stride_g
        tl.atomic_add(p_acc + o_d, b_acc, mask=m_d, sem="relaxed")
        tl.atomic_add(p_acc + D, tl.sum(b_gb, axis=0), sem="relaxed")
        tl.atomic_add(p_acc + D + 1, tl.sum(b_loss, axis=0), sem="relaxed")
    if ATOMIC_TAIL == 2:
        if _last_out(ctr_ptr, tl.num_programs(0)):
            _reset(ctr_ptr, 16)
    if ATOMIC_TAIL == 3:
        if _last_out(ctr_ptr, tl.num_programs(0)):
            tl.debug_barrier()
            for r in range(0, tl.cdiv(D + 2, BLOCK_R)):
                _reduce_rows(acc_ptr, stride_g, ACC_COPIES, D, 1, gw_ptr, gb_ptr, loss_ptr, scale, r,
                             True, False, True, ACC_COPIES, BLOCK_R)
                o_f = r * BLOCK_R + tl.arange(0, BLOCK_R)
                for k in tl.static_range(ACC_COPIES):
                    tl.store(acc_ptr + k * stride_g + o_f, tl.zeros([BLOCK_R], dtype=tl.float32), mask=o_f < D + 2)
            _reset(ctr_ptr, 16)
    if ATOMIC_TAIL == 0:
        tl.store(part_ptr + pid * BLOCK_D + o_d, b_acc, mask=m_d)


def stream_head(h: torch.Tensor, dz: torch.Tensor, weight: torch.Tensor, *, relu: bool = False,
                act_out: torch.Tensor | None = None, config: LaunchConfig = LaunchConfig(),
                dissect: dict | None = None, info: dict | None = None) -> torch.Tensor:
    """grad_h = dz[:, None] * weight (masked where h <= 0 if relu) for h [N, D] (unit stride on D),
    dz [N] float, weight [1, D]; act_out (relu only): a contiguous tensor like h that receives
    relu(h). The dense head's tile rule, register cap and grid for `config` (deterministic=False:
    its atomic, statically split mode). Returns grad_h, contiguous, h's dtype.

    dissect (benchmarks only): dict(y=[N] float targets, bias=[1], scale=1/N) computes dz as the
    fused BCE head does (dz is then ignored; reload=True loads each h tile a second time after the
    row reduction instead of holding it); dict(..., outputs=`dissect_outputs(D, ...)`) also sums
    grad_W, grad_b and the loss with the fused kernel's atomics (its accumulators and counters are
    left zeroed), tail=1 (the atomics only; the accumulators are then left dirty), 2 (and the
    last-out counter) or 3 (default: and the last program's sum).
    info: a dict that receives the grid size P, num_warps, and the compiled kernel's registers,
    spills and shared memory."""
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
        raise ValueError(f"stream_head covers whole-row tiles only; the dense rule splits D={D} into chunks of {bd}")
    grad_h = torch.empty_like(h)
    n_tiles = -(-N // bn)
    d = dissect or {}
    outs = d.get("outputs")
    maxnreg = (config.max_registers or blk["maxnreg"]) if cuda else None  # the dense plan's register cap
    opts = dict(num_warps=warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    cx = dict(BLOCK_N=bn, BLOCK_D=bd, NUM_STAGES=stages, RELU=relu, STORE_ACT=act_out is not None,
              COMPUTE_DZ=(2 if d.get("reload") else 1) if "y" in d else 0,
              ATOMIC_TAIL=d.get("tail", 3) if outs is not None else 0, ACC_COPIES=_ACC_COPIES, BLOCK_R=512)
    if outs is not None and "y" not in d:
        raise ValueError("dissect: outputs need y, bias and scale (the atomic tail sums what COMPUTE_DZ computes)")
    stride_g = _stride_g(D)
    part = torch.empty(1, dtype=torch.float32, device=h.device)  # (warm-up: any fp32 pointer)
    y, b, scale = d.get("y", dz), d.get("bias", dz), float(d.get("scale", 1.0))
    gw, gb, loss, acc, ctr = outs if outs is not None else (part, part, part, part, part)

    def args(part):
        act = act_out if act_out is not None else grad_h
        return (h, dz, weight, grad_h, act, part, y, b, gw, gb, loss, acc, ctr, N, D, h.stride(0), n_tiles, scale,
                stride_g)
    P = min(n_tiles, num_programs(_stream_head_kernel, (h.dtype, tuple(cx.items()), warps),
                                  lambda: _stream_head_kernel.warmup(*args(part), grid=(1,), **opts, **cx),
                                  h.device, warps, config.occupancy, config.programs_per_sm))
    if info is not None:  # the grid and what sized it
        ck = _stream_head_kernel.warmup(*args(part), grid=(1,), **opts, **cx)
        info.update(P=P, num_warps=warps, n_regs=getattr(ck, "n_regs", None), n_spills=getattr(ck, "n_spills", None),
                    shared=int(ck.metadata.shared))
    if outs is None:
        part = torch.empty(P * bd, dtype=torch.float32, device=h.device)
    _stream_head_kernel[(P,)](*args(part), **opts, **cx)
    return grad_h
