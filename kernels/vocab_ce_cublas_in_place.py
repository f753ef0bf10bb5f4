"""The cuBLAS vocabulary CE path with the logits in grad_W's memory ("cublas_in_place"): "ce" with C > 512 and
at most D rows as three cuBLAS GEMMs over every row at once and two Triton kernels, no chunks of rows.

"cublas" (vocab_ce_cublas.py) holds a chunk of rows' logits in a scratch of its own and adds each chunk into
grad_W: a read-modify-write of grad_W and a rounding of it a chunk. Here the logits of all N rows live in
grad_W's own memory until grad_W is written over them: N x C logits fit in C x D where N <= D. Transposed,
z^T = W h^T ([C, N]), each block of classes is a contiguous run of rows, and grad_W's block k is
dz[:, block k]^T h, which reads only z^T's block k. So:

  mean_scale_kernel          1 / the rows not ignored (a mean)
  z^T = W relu?(h)^T         cuBLAS: classes [0, B) into a [B, N] scratch T, classes [B, C) into grad_W's
                             memory from its start (block k >= 1 at grad_W's rows [(k-1)B, kB) x N / D)
  lse_t_kernel               (a program a block of rows and a split of the classes): base-2 max and sum of
                             z + b over the split, and the target's logit where the split holds it
  merge_kernel               (vocab_ce_cublas.py; a program a block of rows): the splits merged in order:
                             each row's lse, gradient factor and loss
  dz_t_kernel                (a program a block of classes, every row in a fixed order): dz over z^T in place,
                             grad_b as the block's sums over the rows in fp32; program 0 sums the loss
  grad_h = dz W              cuBLAS, in fp32 over T's block and the rest (`_sum_mm`), rounded once
  grad_W[block k] = dz_k^T relu?(h), the blocks from the last to the first: block k's output rows
                             [kB, kB + B) start past every block of z^T not yet read (N <= D), so each
                             GEMM writes over logits already used; block 0's input is T

What it buys: grad_W is written once, by one GEMM a block (no read-modify-write, one rounding, like eager
PyTorch's), every row in one chunk, and the call allocates only T (B x N), grad_h and an fp32 grad_h: at
(4096, 4096, 128256) 16 + 32 + 64 MiB besides grad_W (`cublas`: a 501 MiB scratch of 1536 rows); H100
figures in docs/tuning.md#vocabulary-ce-paths. What it takes: N <= D (the logits
fit in grad_W) and a grad_W it writes, not one it adds to (accumulate refused: an existing .grad holds
values); the rest as vocab_ce_cublas.py's (bf16 or fp32, the whole device, logits rounded to h's dtype,
capturable, deterministic). Reference: `erase_triton.reference.local_head`; tests: tests/test_vocab_ce.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .vocab_ce_cublas import LOG2E, MERGE_BLOCK, CublasCall, ce_dz, loss_total, merge_kernel
from .vocab_ce_cublas_vocab_chunks import _sum_mm

__all__ = ["CublasInPlaceLaunch", "dz_t_kernel", "lse_t_kernel"]

# lse_t_kernel's tile: up to LSE_T_ROWS rows (contiguous) by LSE_T_ELEMS / rows classes (8 to 64), 8 warps: at
# (4096, 4096, 128256) bf16 on an H100, 8 x 2048 read the logits in 0.35 ms, 64 x 64 in 1.89 ms (short runs
# of a row: 128 B) and row_lse_kernel's row-major read took 0.43; its programs: the splits of the classes
# make about two a SM on an H100 or H200. dz_t_kernel's tile (classes, rows, warps) is vocab_ce_cublas.py's
# 64 x 128 dz tile transposed: 0.73 ms there, as that kernel's 0.74
LSE_T_ROWS, LSE_T_ELEMS, LSE_T_WARPS, LSE_T_PROGRAMS = 2048, 16384, 8, 264
DZ_T_TILE = (64, 128, 8)


@triton.jit
def _block_ptr(t_ptr, g_ptr, c, B, N):
    # where class c's row of z^T starts: T's row c below B, else grad_W's memory at row c - B (offsets in int64;
    # N may be a plain int: Triton specializes N = 1)
    n = tl.full([], 0, tl.int64) + N
    return tl.where(c < B, t_ptr + c * n, g_ptr + (c - B) * n)


@triton.jit
def lse_t_kernel(t_ptr, g_ptr, b_ptr, y_ptr, part_ptr, B, N, C, cs, HAS_BIAS: tl.constexpr,
                 BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    # rows [pid0 * BLOCK_N, +BLOCK_N), classes [pid1 * cs, +cs) (cs and B multiples of BLOCK_C, so a tile of
    # classes lies in T or in grad_W's memory): the split's base-2 max and sum of 2^(u - max), u = (z + b)
    # log2(e), and the target's logit where the split holds it (else 0), to part_ptr[k * S * N + s * N + row]
    S = tl.num_programs(1)
    s = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mr = rows < N
    lo = s * cs
    hi = tl.minimum(lo + cs, C)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    sm = tl.zeros([BLOCK_N], dtype=tl.float32)
    o = tl.arange(0, BLOCK_C)
    for c0 in range(lo, hi, BLOCK_C):
        cls = c0 + o
        mc = cls < hi
        base = _block_ptr(t_ptr, g_ptr, c0, B, N)  # (the whole tile's part)
        ptrs = base + o[:, None].to(tl.int64) * N + rows[None, :]
        z = tl.load(ptrs, mask=mc[:, None] & mr[None, :], other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + cls, mask=mc, other=0.0).to(tl.float32)[:, None]
        u = z * LOG2E
        m_new = tl.maximum(m, tl.max(u, 0))
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        sm = sm * tl.exp2(m - ref) + tl.sum(tl.exp2(u - ref[None, :]), 0)
        m = m_new
    t = tl.load(y_ptr + rows, mask=mr, other=-1)
    here = mr & (t >= lo) & (t < hi)
    tc = tl.where(here, t, lo)  # the target's logit, one load (the split's first class where it is elsewhere)
    zt = tl.load(_block_ptr(t_ptr, g_ptr, tc, B, N) + rows, mask=mr, other=0.0).to(tl.float32)
    if HAS_BIAS:
        zt += tl.load(b_ptr + tc, mask=mr, other=0.0).to(tl.float32)
    off = s * N + rows
    tl.store(part_ptr + off, m, mask=mr)
    tl.store(part_ptr + S * N + off, sm, mask=mr)
    tl.store(part_ptr + 2 * S * N + off, tl.where(here, zt, 0.0), mask=mr)


@triton.jit
def dz_t_kernel(t_ptr, g_ptr, b_ptr, y_ptr, lse_ptr, grad_bias_ptr, rows_loss_ptr, scale_ptr, loss_ptr, B, N, C,
                HAS_BIAS: tl.constexpr, MEAN: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr):
    # classes [pid * BLOCK_C, +BLOCK_C) (in T or in grad_W's memory: B is a multiple of BLOCK_C), every row in
    # blocks of BLOCK_N: dz = f (softmax - onehot(t)) over z^T in place, from merge_kernel's lse and factor; with
    # a bias, grad_b = the classes' sums of dz over the rows in fp32 (before dz is rounded), in a fixed order.
    # Program 0 also sums the rows' losses into loss_ptr
    c0 = tl.program_id(0) * BLOCK_C
    cls = c0 + tl.arange(0, BLOCK_C)
    mc = cls < C
    base = _block_ptr(t_ptr, g_ptr, c0, B, N)
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cls, mask=mc, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_C, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, N, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        mr = rows < N
        lse2 = tl.load(lse_ptr + rows, mask=mr, other=0.0)
        f = tl.load(lse_ptr + N + rows, mask=mr, other=0.0)
        t = tl.load(y_ptr + rows, mask=mr, other=-1)
        ptrs = base + tl.arange(0, BLOCK_C)[:, None].to(tl.int64) * N + rows[None, :]
        m = mc[:, None] & mr[None, :]
        z = tl.load(ptrs, mask=m, other=0.0).to(tl.float32) + bias[:, None]
        dz = ce_dz(z, f[None, :], lse2[None, :], cls[:, None] == t[None, :])
        tl.store(ptrs, dz.to(t_ptr.dtype.element_ty), mask=m)
        if HAS_BIAS:
            acc += tl.where(m, dz, 0.0)
    if HAS_BIAS:
        tl.store(grad_bias_ptr + cls, tl.sum(acc, 1).to(grad_bias_ptr.dtype.element_ty), mask=mc)
    if tl.program_id(0) == 0:
        loss_total(rows_loss_ptr, N, scale_ptr, loss_ptr, MEAN)


class CublasInPlaceLaunch(CublasCall):
    """One vocab_path="cublas_in_place" head call with everything but the tensors fixed; called like
    `plan.HeadLaunch`: (h, weight, bias, y, grad_weight, grad_bias, act=None) -> (loss, grad_h).

    N <= D rows, C classes in blocks of `block` (T's rows; rounded up to the kernels' class tiles). splits:
    lse_t_kernel's splits of the classes (None: about LSE_T_PROGRAMS programs in all). example (CUDA): (h's
    dtype, bias, y, grad_bias) of the signature being prepared: the Triton kernels are compiled for them here
    and launched directly (kernels/direct.py); without it, `kernel[grid](...)`."""

    __slots__ = ("N", "C", "D", "block", "mean", "ignore_index", "relu", "has_bias", "poison", "index",
                 "scale_launch", "lse_launch", "merge_launch", "dz_launch", "n_buf", "o_lse", "o_part", "o_scale",
                 "loss_like", "first_cx", "splits", "cs", "__weakref__")

    def __init__(self, N: int, C: int, D: int, block: int, mean: bool, ignore_index: int, relu: bool,
                 has_bias: bool, device: torch.device, poison: bool = False, splits: int | None = None,
                 example: tuple | None = None):
        assert N <= D, f"cublas_in_place holds N x C logits in grad_W's C x D: N={N} > D={D}"
        self.N, self.C, self.D, self.mean, self.ignore_index, self.relu = N, C, D, mean, ignore_index, relu
        self.has_bias, self.poison = has_bias, poison
        cuda = example is not None
        ln = min(LSE_T_ROWS, triton.next_power_of_2(N))
        lc, lw = min(64, max(8, LSE_T_ELEMS // ln)), LSE_T_WARPS
        dc, dn, dw = DZ_T_TILE
        cdiv = lambda a, b: -(-a // b)  # noqa: E731
        tile = max(lc, dc)  # (a tile of classes lies in T or in grad_W's memory)
        self.block = B = min(cdiv(block, tile), cdiv(C, tile)) * tile
        S = max(1, min(splits or cdiv(LSE_T_PROGRAMS, cdiv(N, ln)), cdiv(C, lc)))
        self.cs = cs = cdiv(cdiv(C, S), lc) * lc  # classes a split, in whole tiles
        self.splits = S = cdiv(C, cs)
        self.first_cx = dict(HAS_BIAS=has_bias, BLOCK_C=lc, BLOCK_N=ln, num_warps=lw if cuda else 1)
        # the fp32 scratch, one allocation: [rows' losses N | lse and factor 2N | splits' max, sum, target 3SN |
        # scale 1], each part at a 16-byte boundary (what the direct launches were compiled for)
        pad = lambda n: -(-n // 4) * 4  # noqa: E731
        self.o_lse = pad(N)
        self.o_part = self.o_lse + pad(2 * N)
        self.o_scale = self.o_part + pad(3 * S * N)
        self.n_buf = self.o_scale + 1
        launch, ex = self.setup(N, mean, ignore_index, has_bias, device, example)
        f32 = torch.float32
        hdt, b_ex, y, gb_ex = ex
        self.lse_launch = launch(lse_t_kernel, (-(-N // ln), S), self.first_cx,
                                 lambda: (hdt, hdt, b_ex, y, f32, B, N, C, cs))
        self.merge_launch = launch(merge_kernel, -(-N // MERGE_BLOCK),
                                   dict(MEAN=mean, INIT=False, BLOCK=MERGE_BLOCK, num_warps=4 if cuda else 1),
                                   lambda: (f32, y, f32, f32, f32, S, N, C, ignore_index))
        self.dz_launch = launch(dz_t_kernel, -(-C // dc),
                                dict(HAS_BIAS=has_bias, MEAN=mean, BLOCK_C=dc, BLOCK_N=dn, num_warps=dw if cuda else 1),
                                lambda: (hdt, hdt, b_ex, y, f32, gb_ex, f32, f32, f32, B, N, C))

    @property
    def kernel(self):
        """The first Triton kernel (what plan._PLANS records)."""
        return lse_t_kernel

    def __call__(self, h, weight, bias, y, grad_weight, grad_bias, act=None):
        shape, h, y, x, stream = self.start(h, y, act)
        N, C, B = self.N, self.C, self.block
        f32_sum = h.dtype != torch.float32
        grad_h, buf, loss, t = self.buffers(h, (min(B, C), N), torch.float32)
        rows_loss, lse, part, scale = self.views(buf, y, stream)
        if not self.has_bias:
            bias, grad_bias = weight, lse  # unused pointers (HAS_BIAS=False; not t, which would outlive its `del`)
        rest = C - t.shape[0]
        g = grad_weight.view(-1)[: rest * N].view(rest, N)  # z^T of classes [B, C): grad_W's memory from its start
        torch.mm(weight[:B], x.t(), out=t)
        if rest:
            torch.mm(weight[B:], x.t(), out=g)
        gp = g if rest else t  # (no class past B: an unused pointer)
        self.lse_launch(stream, t, gp, bias, y, part, B, N, C, self.cs)
        self.merge_launch(stream, part, y, scale, rows_loss, lse, self.splits, N, C, self.ignore_index)
        self.dz_launch(stream, t, gp, bias, y, lse, grad_bias, rows_loss, scale, loss, B, N, C)
        _sum_mm(grad_h, t.t(), weight[:B], False, f32_sum)
        if rest:
            _sum_mm(grad_h, g.t(), weight[B:], True, f32_sum)
        # grad_W's blocks from the last: block k's rows [kB, kB + B) lie past z^T's blocks 1..k (N <= D), so
        # each GEMM writes over logits already used; block 0 reads T
        for k in range(-(-C // B) - 1, 0, -1):
            c0, c1 = k * B, min(k * B + B, C)
            torch.mm(g[c0 - B:c1 - B], x, out=grad_weight[c0:c1])
        torch.mm(t, x, out=grad_weight[:B])
        del t  # (the scratch's memory back before grad_h's rounded copy)
        if self.relu:
            grad_h.masked_fill_(h <= 0, 0)
        return loss, grad_h.to(h.dtype).view(shape)
