"""The cuBLAS vocabulary CE path in chunks of classes ("cublas_vocab_chunks"): "ce" with C > 512 as four cuBLAS
GEMMs and two Triton kernels a chunk of columns, in a scratch of N rows x `chunk` classes.

"cublas" (vocab_ce_cublas.py) takes chunks of rows: three GEMMs, but each chunk's logits span the whole
vocabulary, so its scratch holds at least CUBLAS_MIN_ROWS x C values (62.5 MiB at C = 32000) and grad_W is
read and written once a chunk. Here a chunk holds every row and `chunk` classes, so the logits are computed
twice (but for the one or two chunks kept): once for the rows' log-sum-exp, once for dz. What that buys: a
scratch of any size, grad_W and grad_b written once (each chunk owns its rows of them), and only grad_h
(N x D) added to across chunks. For a narrow h (small D) the extra GEMM is cheap and the scratch is the
largest thing a call allocates.

  mean_scale_kernel                    1 / the rows not ignored (a mean)
  chunks: `chunk` classes each, but the first, which holds what is left over (the last is whole)
  pass 1, chunk k of classes [v0, v1):
    z_k = relu?(h) W[v0:v1]^T          cuBLAS (cuBLASLt where LT_GEMMS says), into the [N, chunk] scratch in h's dtype
    chunk_lse_kernel (a program a row): the chunk's base-2 max and sum of z_k + b merged into the row's running
                                       pair; the target's logit from the chunk that holds it; the last chunk
                                       turns them into the row's lse, gradient factor and loss
    the logits of the kept chunks stay for pass 2: the last's in the scratch and, unless grad_W is added to,
    the second-last's in grad_W's first rows (where they fit: written only after that chunk's gradients)
    on Hopper (compute capability 9.x, bf16 h), the kept chunks so (the first of them FIRST), then every other
    one at once: vocab_ce_lse_gemm.py's Gluon kernel, the logits GEMM with the rows' max and sum in its
                                       epilogue, and its merge into that running pair (two launches, no logits
                                       written)
  pass 2, the chunks in reverse (the kept ones' logits are still there: not computed again):
    z_k again                          cuBLAS
    dz_split_kernel (a program a block of columns and of rows): dz over z_k in place (as vocab_ce_cublas's
                                       dz_rows), its column sums in fp32 per block of rows; without a bias
                                       dz_band_kernel (a program a block of rows, along them), no sums
    grad_W[v0:v1] = dz^T relu?(h)      cuBLAS, written once (addmm where the call accumulates)
    grad_h (+)= dz W[v0:v1]            cuBLAS into an fp32 [N, D] sum (a 16-bit grad_h rounded once a
                                       chunk: 2.8x eager's error at 11 chunks), rounded once at the end
  colsum_loss_kernel                   grad_b from the blocks' sums in a fixed order; the loss summed

Rounding, launches, capture, determinism and the inputs taken are as vocab_ce_cublas.py's.
Reference: `erase_triton.reference.local_head`; tests: tests/test_vocab_ce.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ce_rows, grad_scale
from . import vocab_ce_lse_gemm
from .vocab_ce_cublas import LN2, LSE_GROUP, LSE_WARPS, CublasCall, ce_dz, dz_rows, loss_total, row_max_sum

__all__ = ["CublasVocabLaunch", "chunk_lse_kernel", "colsum_loss_kernel", "dz_band_kernel", "dz_kernel",
           "dz_split_kernel"]

# chunk_lse_kernel's block (columns a load); dz_split_kernel's blocks of rows per block of columns and its tile;
# of those tried at (4096, 512, 32000) bf16 on an H100 the fastest (blocks 1024-4096 level; 4, 8 and 16 splits;
# tiles 32 x 256 x 8 warps, 64 x 128 x 8, 64 x 64 x 4)
VLSE_BLOCK, DZ_SPLITS, VDZ_TILE, COLSUM_BLOCK = 1024, 8, (64, 64, 4), 1024
# dz_band_kernel's tile (rows, columns, warps), without a bias
VDZ_BAND_TILE = (8, 512, 4)
# the dz kernels' loop pipelining depth (dz_rows' STAGES; 0: a plain loop; read when a call is prepared): 2-4 no
# faster in the call on an H100, dz_split_kernel alone slower (docs/tuning.md; for A/B runs on other GPUs)
DZ_STAGES = 0
# the GEMM sites of a call, and those (LT_GEMMS) to compute with cuBLASLt as PyTorch's preferred BLAS library (set
# for those calls alone and put back; read when a call runs), none by default: for the logits alone both libraries
# pick the same kernels on an H200 and an H100, so the switch only cost host time; cuBLASLt preferred for the
# whole call was faster on an H200, no site was on an H100 (docs/tuning.md; for A/B runs)
LT_SITES = ("logits", "grad_weight", "grad_h")
LT_GEMMS = frozenset()
_LT = getattr(getattr(torch._C, "_BlasBackend", None), "Cublaslt", None)


@triton.jit
def chunk_lse_kernel(z_ptr, b_ptr, y_ptr, scale_ptr, loss_ptr, lse_ptr, v0, n, N, C, stride_z, ignore_index,
                     HAS_BIAS: tl.constexpr, MEAN: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                     BLOCK: tl.constexpr, GROUP: tl.constexpr):
    # row r, classes [v0, v0 + n) (z: that chunk's logits without the bias): the chunk's base-2 max and sum merged
    # into the row's running pair at lse_ptr[r], lse_ptr[N + r], and the target's logit into loss_ptr[r] where the
    # chunk holds it. The last chunk leaves there what row_lse_kernel leaves: the row's base-2 lse and gradient
    # factor, and its unscaled loss
    r = tl.program_id(0)
    row = z_ptr + r.to(tl.int64) * stride_z
    t = tl.load(y_ptr + r)
    mx, sm = row_max_sum(row, b_ptr + v0, n, HAS_BIAS, BLOCK, GROUP)
    here = (t >= v0) & (t < v0 + n)
    tc = tl.where(here, t - v0, 0)  # the target's logit, one load (the chunk's first where it is elsewhere)
    zt = tl.load(row + tc).to(tl.float32)
    if HAS_BIAS:
        zt += tl.load(b_ptr + v0 + tc).to(tl.float32)
    zt = tl.where(here, zt, 0.0)
    if not FIRST:  # merge with the chunks before
        m0 = tl.load(lse_ptr + r)
        s0 = tl.load(lse_ptr + N + r)
        mn = tl.maximum(m0, mx)
        sm = s0 * tl.exp2(m0 - mn) + sm * tl.exp2(mx - mn)
        mx = mn
        zt += tl.load(loss_ptr + r)  # (adding the 0 of every other chunk: exact)
    if LAST:
        counts, bad = ce_rows(t, t == t, ignore_index, C)
        scale = 1.0
        if MEAN:
            scale = grad_scale(tl.load(scale_ptr))
        lse2 = mx + tl.log2(sm)
        tl.store(loss_ptr + r, tl.where(counts, lse2 * LN2 - zt, 0.0) + bad)
        tl.store(lse_ptr + r, lse2)
        tl.store(lse_ptr + N + r, tl.where(counts, scale, 0.0) + bad)
    else:
        tl.store(loss_ptr + r, zt)
        tl.store(lse_ptr + r, mx)
        tl.store(lse_ptr + N + r, sm)


@triton.jit
def dz_split_kernel(z_ptr, b_ptr, y_ptr, lse_ptr, part_ptr, v0, n, N, C, rows_per, stride_z,
                    HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                    STAGES: tl.constexpr = 0):
    # dz over z in place for classes v0 + [pid0 * BLOCK_C, +BLOCK_C) of the chunk and rows [pid1 * rows_per,
    # +rows_per); with a bias, their column sums of dz in fp32 to part_ptr[pid1, class] (summed by
    # colsum_loss_kernel in a fixed order)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = cols < n
    classes = v0 + cols
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + classes, mask=mc, other=0.0).to(tl.float32)
    r_lo = tl.program_id(1) * rows_per
    r_hi = tl.minimum(r_lo + rows_per, N)
    col = dz_rows(z_ptr, y_ptr, lse_ptr, N, stride_z, cols, classes, mc, bias, r_lo, r_hi, HAS_BIAS, BLOCK_R, BLOCK_C,
                  STAGES)
    if HAS_BIAS:
        tl.store(part_ptr + tl.program_id(1) * C + classes, col, mask=mc)


@triton.jit
def dz_band_block(base, tc, lse2, f, mr, c0, n, BLOCK_C: tl.constexpr):
    # dz_band_kernel's step: its rows' classes [c0, c0 + BLOCK_C) below n
    cols = c0 + tl.arange(0, BLOCK_C)
    m = mr[:, None] & (cols < n)[None, :]
    z = tl.load(base + cols[None, :], mask=m, other=0.0).to(tl.float32)
    dz = ce_dz(z, f[:, None], lse2[:, None], cols[None, :] == tc[:, None])
    tl.store(base + cols[None, :], dz.to(base.dtype.element_ty), mask=m)


@triton.jit
def dz_band_kernel(z_ptr, b_ptr, y_ptr, lse_ptr, part_ptr, v0, n, N, C, rows_per, stride_z,
                   HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr = 0):
    # without a bias (no column sums): dz over z in place for rows [pid * BLOCK_R, +BLOCK_R) and the chunk's n
    # classes in blocks of BLOCK_C, so a program's loads run along its rows (dz_split_kernel's arguments, the
    # bias, sums and split unused); STAGES as dz_rows'
    tl.static_assert(not HAS_BIAS)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = rows < N
    lse2 = tl.load(lse_ptr + rows, mask=mr, other=0.0)
    f = tl.load(lse_ptr + N + rows, mask=mr, other=0.0)
    tc = tl.load(y_ptr + rows, mask=mr, other=-1) - v0
    base = z_ptr + rows[:, None].to(tl.int64) * stride_z
    if STAGES > 0:
        for c0 in tl.range(0, n, BLOCK_C, num_stages=STAGES):
            dz_band_block(base, tc, lse2, f, mr, c0, n, BLOCK_C)
    else:
        for c0 in range(0, n, BLOCK_C):
            dz_band_block(base, tc, lse2, f, mr, c0, n, BLOCK_C)


@triton.jit
def colsum_loss_kernel(part_ptr, S, C, grad_bias_ptr, rows_loss_ptr, N, scale_ptr, loss_ptr, HAS_BIAS: tl.constexpr,
                       ACCUMULATE: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    # grad_b for a block of classes: the S blocks of rows' fp32 sums in order, rounded once (added to grad_b in
    # fp32 where the call accumulates); program 0 also sums the loss
    if HAS_BIAS:
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mc = cols < C
        col = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, S):
            col += tl.load(part_ptr + i * C + cols, mask=mc, other=0.0)
        if ACCUMULATE:
            col += tl.load(grad_bias_ptr + cols, mask=mc, other=0.0).to(tl.float32)
        tl.store(grad_bias_ptr + cols, col.to(grad_bias_ptr.dtype.element_ty), mask=mc)
    if tl.program_id(0) == 0:
        loss_total(rows_loss_ptr, N, scale_ptr, loss_ptr, MEAN)


def dz_kernel(has_bias: bool, dz_tile: tuple | None = None):
    """The dz kernel a chunk runs and its tile (rows, columns, warps): dz_split_kernel with a bias (it also
    writes the column sums), else dz_band_kernel."""
    return (dz_split_kernel, dz_tile or VDZ_TILE) if has_bias else (dz_band_kernel, dz_tile or VDZ_BAND_TILE)


class CublasVocabLaunch(CublasCall):
    """One vocab_path="cublas_vocab_chunks" head call with everything but the tensors fixed; called like
    `plan.HeadLaunch`: (h, weight, bias, y, grad_weight, grad_bias, act=None) -> (loss, grad_h).

    C classes in chunks of `chunk` (every N rows each). block: chunk_lse_kernel's columns a load
    (LaunchConfig.block_v); splits: dz_split_kernel's blocks of rows; dz_tile (rows, columns, warps): its tile, or
    without a bias dz_band_kernel's, for tuning.
    D: h's width, which decides (with the device and h's dtype) whether pass 1 is the Gluon kernel.
    example (CUDA): (h's dtype, bias, y, grad_bias) of the signature being prepared: the Triton kernels are
    compiled for them here and launched directly (kernels/direct.py); without it, `kernel[grid](...)`."""

    __slots__ = ("N", "C", "chunk", "mean", "ignore_index", "relu", "accumulate", "has_bias", "poison", "index",
                 "scale_launch", "steps", "final_launch", "n_buf", "o_lse", "o_part", "o_scale", "loss_like",
                 "first_cx", "splits", "rows_per", "lse_gemm", "kept", "kept_lse", "o_gl", "__weakref__")

    def __init__(self, N: int, C: int, chunk: int, mean: bool, ignore_index: int, relu: bool, accumulate: bool,
                 has_bias: bool, device: torch.device, poison: bool = False, block: int | None = None,
                 splits: int | None = None, dz_tile: tuple | None = None, example: tuple | None = None,
                 D: int | None = None):
        V = min(chunk, C)
        self.N, self.C, self.chunk, self.mean, self.ignore_index, self.relu = N, C, V, mean, ignore_index, relu
        self.accumulate, self.has_bias, self.poison = accumulate, has_bias, poison
        cuda = example is not None
        br = (dz_tile or VDZ_TILE)[0]
        dz, (r, c, wp) = dz_kernel(has_bias, dz_tile)
        rows_per = -(-N // (splits or DZ_SPLITS))
        rows_per = -(-rows_per // br) * br
        S = -(-N // rows_per)
        lb = min(block or VLSE_BLOCK, triton.next_power_of_2(V))
        # chunk_lse_kernel's launch keywords, less FIRST and LAST (each chunk's)
        self.first_cx = dict(HAS_BIAS=has_bias, MEAN=mean, BLOCK=lb, GROUP=min(LSE_GROUP, lb),
                             num_warps=LSE_WARPS if cuda else 1)
        lse_cx = lambda first, last: dict(self.first_cx, FIRST=first, LAST=last)  # noqa: E731
        # the fp32 scratch, one allocation: [rows' losses N | running pair, then lse and factor 2N | grad_b's
        # sums S x C | scale 1], each part at a 16-byte boundary (what the direct launches were compiled for)
        pad = lambda n: -(-n // 4) * 4  # noqa: E731
        self.o_lse = pad(N)
        self.o_part = self.o_lse + pad(2 * N)
        self.o_scale = self.o_part + (pad(S * C) if has_bias else 0)
        self.n_buf = self.o_scale + 1
        launch, ex = self.setup(N, mean, ignore_index, has_bias, device, example)
        f32 = torch.float32
        hdt, b_ex, y, gb_ex = ex

        def lse_launch(v0, n, first, last):  # chunk_lse_kernel over classes [v0, v0 + n)
            return launch(chunk_lse_kernel, N, lse_cx(first, last),
                          lambda: (hdt, b_ex, y, f32, f32, f32, v0, n, N, C, n, ignore_index))
        # the first chunk holds what is left over, so the last (not computed twice: pass 2 starts there) is whole
        bounds = [0] + list(range(C - (C - 1) // V * V, C + 1, V))
        K = len(bounds) - 1
        # the chunks whose logits stay from pass 1 to pass 2: the last, in the scratch, and without accumulate
        # the one before it where they fit below its rows of grad_W (written only after its gradients, and
        # the rows below it after that)
        self.kept = 1 + (not accumulate and D is not None and K > 2 and N * V <= bounds[-3] * D)
        self.lse_gemm, self.kept_lse = None, []
        g = bounds[K - self.kept]  # (the Gluon pass's classes)
        if cuda and D is not None and g > 0 and vocab_ce_lse_gemm.usable(device, hdt, D):
            # the Gluon pass over the chunks not kept, after cuBLAS' logits of the kept ones (FIRST, not LAST);
            # its scratch after the scale: the splits' pairs, then the targets' logits
            self.lse_gemm = vocab_ce_lse_gemm.LseGemm(N, C, D, mean, ignore_index, has_bias, device, launch, y,
                                                      classes=g)
            self.o_gl = pad(self.n_buf)
            self.n_buf = self.o_gl + self.lse_gemm.n_part
            for v0, v1 in zip(bounds[K - self.kept:-1], bounds[K - self.kept + 1:]):
                self.kept_lse.append(lse_launch(v0, v1 - v0, v0 == g, False))
        built, self.steps = {}, []
        for v0, v1 in zip(bounds, bounds[1:]):
            n, first, last = v1 - v0, v0 == 0, v1 == C
            # (v0's divisibility by 16 is part of what a direct launch was compiled for)
            key = (n, first, last, v0 % 16 == 0)
            if key not in built:
                a = lse_launch(v0, n, first, last)
                grid = (-(-n // c), S) if has_bias else -(-N // r)
                d = launch(dz, grid, dict(HAS_BIAS=has_bias, BLOCK_R=r, BLOCK_C=c, STAGES=DZ_STAGES,
                                          num_warps=wp if cuda else 1),
                           lambda n=n, v0=v0: (hdt, b_ex, y, f32, f32, v0, n, N, C, rows_per, n))
                built[key] = (a, d)
            self.steps.append((v0, v1) + built[key])
        self.final_launch = launch(colsum_loss_kernel, -(-C // COLSUM_BLOCK) if has_bias else 1,
                                   dict(HAS_BIAS=has_bias, ACCUMULATE=accumulate, MEAN=mean, BLOCK=COLSUM_BLOCK,
                                        num_warps=4 if cuda else 1),
                                   lambda: (f32, S, C, gb_ex, f32, N, f32, f32))
        self.splits, self.rows_per = S, rows_per

    @property
    def kernel(self):
        """The first Triton kernel (what plan._PLANS records)."""
        return chunk_lse_kernel

    def __call__(self, h, weight, bias, y, grad_weight, grad_bias, act=None):
        shape, h, y, x, stream = self.start(h, y, act)
        N, C = self.N, self.C
        # grad_h summed over the chunks in fp32 (16-bit inputs: cuBLAS' fp32 output; on the CPU, fp32 products of
        # the same values, which are exact)
        f32_sum = h.dtype != torch.float32
        grad_h, buf, loss, z = self.buffers(h, N * self.chunk, torch.float32)
        rows_loss, lse, part, scale = self.views(buf, y, stream)
        if not self.has_bias:
            # unused pointers (HAS_BIAS=False; not z, which would outlive its `del`)
            bias, part, grad_bias = weight, lse, lse
        ii, S, rp = self.ignore_index, self.splits, self.rows_per
        # the views each made once a call (the host's cost of a call is mostly its torch calls)
        views, zs = [], {}
        for v0, v1, _, _ in self.steps:
            n = v1 - v0
            if n not in zs:
                zs[n] = z[: N * n].view(N, n)
            wk = weight[v0:v1]
            views.append([wk, wk.t(), grad_weight[v0:v1], zs[n]])
        K, kept = len(self.steps), self.kept
        if kept == 2:  # the second-last chunk's logits in grad_W's first rows (grad_W: contiguous in h's dtype,
            # as local_head_into and check_cublas_inputs ask)
            views[K - 2][3] = grad_weight.view(-1)[: N * self.chunk].view(N, self.chunk)
        # pass 1: with the Gluon pass, cuBLAS' logits of the kept chunks only (their own lse launches), else of all
        fused = self.lse_gemm is not None and self.lse_gemm.takes(x, weight)
        first = K - kept if fused else 0
        lse_ks = self.kept_lse if fused else [step[2] for step in self.steps]
        for (v0, v1, _, _), (_, wkt, _, zc), lse_k in zip(self.steps[first:], views[first:], lse_ks):
            _gemm("logits", torch.mm, x, wkt, out=zc)
            lse_k(stream, zc, bias, y, scale, rows_loss, lse, v0, v1 - v0, N, C, v1 - v0, ii)
        if fused:
            self.lse_gemm(stream, x, weight, bias, y, buf[self.o_gl:self.o_gl + self.lse_gemm.n_part], scale,
                          rows_loss, lse)
        for i, ((v0, v1, _, dz_k), (wk, wkt, gwk, zc)) in enumerate(zip(reversed(self.steps), reversed(views))):
            n = v1 - v0
            if i >= kept:  # (the kept chunks' logits are still there from pass 1)
                _gemm("logits", torch.mm, x, wkt, out=zc)
            dz_k(stream, zc, bias, y, lse, part, v0, n, N, C, rp, n)
            if self.accumulate:
                _gemm("grad_weight", gwk.addmm_, zc.t(), x)
            else:
                _gemm("grad_weight", torch.mm, zc.t(), x, out=gwk)
            _gemm("grad_h", _sum_mm, grad_h, zc, wk, i > 0, f32_sum)
        self.final_launch(stream, part, S, C, grad_bias, rows_loss, N, scale, loss)
        del z, zc, zs, views  # (the scratch's memory back before grad_h's rounded copy)
        if self.relu:
            grad_h.masked_fill_(h <= 0, 0)
        return loss, grad_h.to(h.dtype).view(shape)


def _gemm(site, fn, *args, **kw):
    # fn(*args, **kw); for a site in LT_GEMMS on CUDA with cuBLASLt preferred (the preference is process-wide, so
    # another thread's GEMM issued meanwhile may take cuBLASLt as well)
    if site not in LT_GEMMS or _LT is None or not args[0].is_cuda:
        return fn(*args, **kw)
    prev = torch._C._get_blas_preferred_backend()
    torch._C._set_blas_preferred_backend(_LT)
    try:
        return fn(*args, **kw)
    finally:
        torch._C._set_blas_preferred_backend(prev)


def _sum_mm(out, a, b, add: bool, f32_sum: bool) -> None:
    # out (fp32) = or += a @ b; 16-bit a and b: cuBLAS' fp32 output (mm/addmm out_dtype), or on the CPU (which
    # has no out_dtype) the fp32 product of the same values
    if f32_sum and a.is_cuda:
        if add:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
        return
    if f32_sum:
        a, b = a.float(), b.float()
    if add:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)
