"""The cuBLAS vocabulary CE path: "ce" with C > 512 as three cuBLAS GEMMs and two Triton kernels a chunk of rows;
the default for bf16 at full occupancy (`plan.vocab_path_for`).

The Triton paths (vocab_ce_vocab_chunks.py, vocab_ce_row_chunks.py) run their GEMM passes at 320-440
TFLOP/s, against about 600 for cuBLAS (docs/tuning.md#vocabulary-ce-paths). This path hands the GEMMs
to cuBLAS (torch.mm) and keeps in Triton only what cuBLAS cannot fuse. Per chunk of rows (host-sized,
`plan.chunk_size_for`):

  z        = relu?(h_c) W^T          cuBLAS, into an [R, C] scratch in h's dtype
  softmax_dz_kernel (one program a row): lse of z + b (the row in registers up to 32768 classes, else
             online over column blocks), the row's loss,
             dz = s * (softmax - onehot(t)) written over z in h's dtype (s: 1 / counted rows for a mean)
  grad_h_c = dz W                    cuBLAS, straight into grad_h's rows
  grad_W  += dz^T relu?(h_c)          cuBLAS (addmm: one rounding to grad_W's dtype a chunk, as row_chunks)
  grad_b  += column sums of dz        column_sum_kernel, in fp32, rounded once at the end

What it costs against the Triton paths: the logits are rounded to h's dtype before the softmax (as
eager PyTorch's bf16 Linear rounds them), several launches a call (no host sync: it is capturable),
and cuBLAS picks its own grid, so `occupancy` does not apply (it takes the whole device). Inputs: bf16
or fp32 (fp32 GEMMs follow torch.backends.cuda.matmul.allow_tf32, like a Linear); fp16 is refused,
since dz is scaled before it is rounded and fp16 would flush a large vocabulary's dz to zero (the
Triton paths scale the fp32 sums instead). Deterministic: cuBLAS GEMMs are run-to-run reproducible
on one device, and the two Triton kernels have no atomics.
Reference: `erase_triton.reference.local_head`; tests: tests/test_vocab_ce.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ce_rows, grad_scale

__all__ = ["CublasLaunch", "check_cublas_inputs", "column_sum_kernel", "softmax_dz_kernel"]

# the softmax kernel: a row of up to ONE_PASS_MAX_C classes is read once (16 warps hold 32768 fp32 at 64 a
# thread); a longer one in blocks of TWO_PASS_BLOCK, twice (the lse, then dz). LaunchConfig(two_pass=, block_v=)
# overrides both (docs/tuning.md#vocabulary-ce-paths)
ONE_PASS_MAX_C, TWO_PASS_BLOCK = 32768, 4096
# column_sum_kernel's tile: the fastest of seven over a [1024, 32000] bf16 chunk on an H100 (36 us, as torch's
# z.sum(0, dtype=float32), which also allocated 140 MB)
COLSUM_BLOCK_R, COLSUM_BLOCK_C, COLSUM_WARPS = 64, 128, 8
LOG2E, LN2 = tl.constexpr(1.4426950408889634), tl.constexpr(0.6931471805599453)


@triton.jit
def softmax_dz_kernel(z_ptr, b_ptr, y_ptr, scale_ptr, loss_ptr, C, stride_z, ignore_index,
                      HAS_BIAS: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    # row r of the chunk: z (logits without the bias) in, dz out, in place; the row's unscaled loss to loss_ptr[r].
    # ONE_PASS (BLOCK >= C): the row stays in registers between the lse and dz (one read of z, not two)
    r = tl.program_id(0)
    row = z_ptr + r.to(tl.int64) * stride_z
    t = tl.load(y_ptr + r)
    counts, bad = ce_rows(t, t == t, ignore_index, C)  # bad: NaN for a class id outside [0, C)
    scale = 1.0
    if MEAN:
        scale = grad_scale(tl.load(scale_ptr))  # 0 where every row is ignored (scale = 1 / 0)
    f = tl.where(counts, scale, 0.0) + bad
    o = tl.arange(0, BLOCK)
    # base 2 throughout (u = z log2(e)): one FMA and one ex2 an element, 18% off the kernel on an H100
    if ONE_PASS:
        mc = o < C
        z = tl.load(row + o, mask=mc, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + o, mask=mc, other=0.0).to(tl.float32)
        mx = tl.max(z, 0) * LOG2E
        lse2 = mx + tl.log2(tl.sum(tl.exp2(z * LOG2E - mx), 0))
        zt = tl.sum(tl.where(o == t, z, 0.0), 0)
        dz = f * (tl.exp2(z * LOG2E - lse2) - tl.where(o == t, 1.0, 0.0))
        tl.store(row + o, dz.to(z_ptr.dtype.element_ty), mask=mc)
    else:
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], dtype=tl.float32)
        zt_l = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, C, BLOCK):  # per lane: running max and sum of exp2, and the target's logit
            cols = c0 + o
            mc = cols < C
            z = tl.load(row + cols, mask=mc, other=float("-inf")).to(tl.float32)
            if HAS_BIAS:
                z += tl.load(b_ptr + cols, mask=mc, other=0.0).to(tl.float32)
            u = z * LOG2E
            m_new = tl.maximum(m, u)
            ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # a lane of padding only: max -inf, sum 0 (no -inf - -inf)
            s = s * tl.exp2(m - ref) + tl.exp2(u - ref)
            m = m_new
            zt_l += tl.where(cols == t, z, 0.0)
        mx = tl.max(m, 0)
        lse2 = mx + tl.log2(tl.sum(s * tl.exp2(m - mx), 0))
        zt = tl.sum(zt_l, 0)
        for c0 in range(0, C, BLOCK):
            cols = c0 + o
            mc = cols < C
            z = tl.load(row + cols, mask=mc, other=0.0).to(tl.float32)
            if HAS_BIAS:
                z += tl.load(b_ptr + cols, mask=mc, other=0.0).to(tl.float32)
            dz = f * (tl.exp2(z * LOG2E - lse2) - tl.where(cols == t, 1.0, 0.0))
            tl.store(row + cols, dz.to(z_ptr.dtype.element_ty), mask=mc)
    tl.store(loss_ptr + r, tl.where(counts, lse2 * LN2 - zt, 0.0) + bad)


@triton.jit
def column_sum_kernel(z_ptr, out_ptr, R, C, stride_z, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # out[c] += sum over the R rows of z[:, c] in fp32: one program a block of columns, its rows in a fixed
    # order (reproducible, no atomics, no scratch)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = cols < C
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        acc += tl.load(z_ptr + rows[:, None].to(tl.int64) * stride_z + cols[None, :],
                       mask=(rows[:, None] < R) & mc[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, tl.load(out_ptr + cols, mask=mc, other=0.0) + tl.sum(acc, 0), mask=mc)


def check_cublas_inputs(h, weight, bias, cfg) -> None:
    """The inputs vocab_path="cublas" takes; ValueError naming what to change otherwise."""
    if h.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"vocab_path='cublas' takes bf16 or fp32 h, got {h.dtype}: its dz is scaled before it is "
                         "rounded, which flushes a large vocabulary's fp16 gradients to zero; use vocab_path='row_chunks'")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != h.dtype:
            raise ValueError(f"vocab_path='cublas' needs {name} in h's dtype ({h.dtype}), got {t.dtype}: cuBLAS "
                             "multiplies one dtype; cast it, or use a Triton path (vocab_path=None)")
    if cfg.fp32_precision is not None:
        raise ValueError("fp32_precision does not apply to vocab_path='cublas': its fp32 GEMMs follow "
                         "torch.backends.cuda.matmul.allow_tf32; leave fp32_precision=None")


class CublasLaunch:
    """One vocab_path="cublas" head call with everything but the tensors fixed; called like `plan.HeadLaunch`:
    (h, weight, bias, y, grad_weight, grad_bias, act=None) -> (loss, grad_h)."""

    __slots__ = ("chunk", "mean", "ignore_index", "relu", "accumulate", "has_bias", "cx", "num_warps", "poison",
                 "colsum_warps", "colsum_grid", "__weakref__")

    def __init__(self, chunk: int, mean: bool, ignore_index: int, relu: bool, accumulate: bool, has_bias: bool,
                 C: int, cuda: bool, poison: bool, two_pass: bool | None = None, block: int | None = None):
        self.chunk, self.mean, self.ignore_index, self.relu = chunk, mean, ignore_index, relu
        self.accumulate, self.has_bias, self.poison = accumulate, has_bias, poison
        # LaunchConfig.two_pass / block_v, else: a row in one block where it fits 64 fp32 registers a thread,
        # else blocks of TWO_PASS_BLOCK lanes over 8 warps (16 a thread), read twice
        c2 = triton.next_power_of_2(C)
        one_pass = not two_pass if two_pass is not None else c2 <= ONE_PASS_MAX_C
        block = c2 if one_pass else min(block or TWO_PASS_BLOCK, c2)
        self.num_warps = min(16, max(8, block // 2048)) if cuda else 1
        self.colsum_warps = COLSUM_WARPS if cuda else 1
        self.colsum_grid = (-(-C // COLSUM_BLOCK_C),)  # (not triton.cdiv: a @jit function, slow from the host)
        self.cx = dict(HAS_BIAS=has_bias, MEAN=mean, BLOCK=block, ONE_PASS=one_pass)  # softmax_dz_kernel's constexprs

    def __call__(self, h, weight, bias, y, grad_weight, grad_bias, act=None):
        # the CUDA fast path passes h [..., D] and y [...] as the caller gave them (the Triton kernels read only
        # their pointers); torch.mm needs the [N, D] matrix
        shape = h.shape
        h, y = h.reshape(-1, shape[-1]), y.reshape(-1)
        N, C = h.shape[0], weight.shape[0]
        x = h
        if self.relu:  # relu(h) by torch, into act when given; the GEMMs read it
            x = torch.clamp_min(h, 0, out=act.view(h.shape)) if act is not None else torch.clamp_min(h, 0)
        grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
        rows_loss = torch.empty(N, dtype=torch.float32, device=h.device)
        if self.poison:  # (tests) an element nobody writes stays NaN
            grad_h.fill_(float("nan"))
            rows_loss.fill_(float("nan"))
        scale = torch.reciprocal((y != self.ignore_index).sum(dtype=torch.float32)) if self.mean else rows_loss
        gb = torch.zeros(C, dtype=torch.float32, device=h.device) if self.has_bias else None
        z = torch.empty(min(self.chunk, N), C, dtype=h.dtype, device=h.device)
        wt = weight.t()
        for r0 in range(0, N, self.chunk):
            r1 = min(r0 + self.chunk, N)
            zc, xc = z[: r1 - r0], x[r0:r1]
            torch.mm(xc, wt, out=zc)
            softmax_dz_kernel[(r1 - r0,)](zc, bias if self.has_bias else zc, y[r0:r1], scale, rows_loss[r0:r1], C,
                                          zc.stride(0), self.ignore_index, **self.cx, num_warps=self.num_warps)
            torch.mm(zc, weight, out=grad_h[r0:r1])
            if r0 == 0 and not self.accumulate:
                torch.mm(zc.t(), xc, out=grad_weight)
            else:
                grad_weight.addmm_(zc.t(), xc)
            if gb is not None:
                column_sum_kernel[self.colsum_grid](zc, gb, r1 - r0, C, zc.stride(0), BLOCK_R=COLSUM_BLOCK_R,
                                                   BLOCK_C=COLSUM_BLOCK_C, num_warps=self.colsum_warps)
        loss = rows_loss.sum()
        if self.mean:
            loss = loss * scale
        if gb is not None:
            if self.accumulate:
                grad_bias.add_(gb)
            else:
                grad_bias.copy_(gb)
        if self.relu:
            grad_h.masked_fill_(h <= 0, 0)
        return loss, grad_h.view(shape)
