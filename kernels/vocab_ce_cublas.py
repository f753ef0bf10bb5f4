"""The cuBLAS vocabulary CE path: "ce" with C > 512 as three cuBLAS GEMMs and two Triton kernels a chunk of rows;
the default for bf16 at full occupancy where "cublas_in_place" does not run (`plan.vocab_path_for`).

The Triton paths (vocab_ce_vocab_chunks.py, vocab_ce_row_chunks.py) run their GEMM passes at 320-440
TFLOP/s, against about 600-750 for cuBLAS (docs/tuning.md#vocabulary-ce-paths). This path hands the GEMMs
to cuBLAS (torch.mm) and keeps in Triton only what cuBLAS cannot fuse. First, for a mean, mean_scale_kernel
takes 1 / the rows not ignored from the targets; then per chunk of rows (host-sized, `plan.chunk_size_for`):

  z        = relu?(h_c) W^T          cuBLAS, into an [R, C] scratch in h's dtype
  row_lse_kernel (one program a row): the row's lse of z + b, read once in blocks; its loss and
             gradient factor s (1 / counted rows for a mean, 0 if ignored)
  dz_colsum_kernel (one program a block of columns, every row of the chunk):
             dz = s * (softmax - onehot(t)) written over z in h's dtype; the column sums of dz in fp32, added
             up over the chunks and, by the last chunk's launch, rounded into grad_b; there too the loss
  grad_h_c = dz W                    cuBLAS, straight into grad_h's rows
  grad_W  += dz^T relu?(h_c)          cuBLAS (addmm: one rounding to grad_W's dtype a chunk, as row_chunks)

A head without a bias and with at most ONE_PASS_MAX_C classes takes one kernel for the two,
softmax_dz_kernel: the row held in registers, z read once (LaunchConfig(two_pass=) picks either form);
loss_total_kernel then sums the loss. The Triton kernels are compiled when the call is prepared and
launched directly (kernels/direct.py): the host's cost of a call is mostly its cuBLAS calls.

What it costs against the Triton paths: the logits are rounded to h's dtype before the softmax (as
eager PyTorch's bf16 Linear rounds them), several launches a call (no host sync: it is capturable),
and cuBLAS picks its own grid, so `occupancy` does not apply (it takes the whole device). Inputs: bf16
or fp32 (fp32 GEMMs follow torch.backends.cuda.matmul.allow_tf32, like a Linear); fp16 is refused,
since dz is scaled before it is rounded and fp16 would flush a large vocabulary's dz to zero (the
Triton paths scale the fp32 sums instead). Deterministic: cuBLAS GEMMs are run-to-run reproducible
on one device, and the Triton kernels have no atomics.
Reference: `erase_triton.reference.local_head`; tests: tests/test_vocab_ce.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import ce_rows, grad_scale, store_scalar, sum_vec
from .direct import KernelLaunch

__all__ = ["CublasCall", "CublasLaunch", "check_cublas_inputs", "dz_colsum_kernel", "first_kernel", "loss_total_kernel",
           "mean_scale_kernel", "merge_kernel", "row_lse_kernel", "softmax_dz_kernel"]

# merge_kernel's rows a program
MERGE_BLOCK = 1024

# softmax_dz_kernel holds a row of up to ONE_PASS_MAX_C classes (16 warps, 64 fp32 a thread) and reads it once
ONE_PASS_MAX_C = 32768
# the two-read form, the fastest tiles over [4096, 32000] and [4096, 128256] bf16 on an H100 (of 8 and 7, the latter
# with and without a bias): row_lse_kernel's block (LaunchConfig.block_v overrides it), lanes a running max, warps;
# dz_colsum_kernel's tile
LSE_BLOCK, LSE_GROUP, LSE_WARPS = 4096, 8, 4
DZ_BLOCK_R, DZ_BLOCK_C, DZ_WARPS = 64, 128, 8
LOG2E, LN2 = tl.constexpr(1.4426950408889634), tl.constexpr(0.6931471805599453)


@triton.jit
def ce_dz(z, f, lse2, hit):
    # the CE gradient of logits z (fp32, without log2(e)) given each row's base-2 lse and factor f, broadcast to
    # z's shape by the caller, and hit (z's shape): where the class is the row's target
    return f * (tl.exp2(z * LOG2E - lse2) - tl.where(hit, 1.0, 0.0))


@triton.jit
def softmax_dz_kernel(z_ptr, y_ptr, scale_ptr, loss_ptr, C, stride_z, ignore_index, MEAN: tl.constexpr,
                      BLOCK: tl.constexpr):
    # row r of the chunk (no bias, C <= BLOCK): z in, dz out, in place, the row held in registers between its lse
    # and dz (one read of z); the row's unscaled loss to loss_ptr[r]
    r = tl.program_id(0)
    row = z_ptr + r.to(tl.int64) * stride_z
    t = tl.load(y_ptr + r)
    counts, bad = ce_rows(t, t == t, ignore_index, C)  # bad: NaN for a class id outside [0, C)
    scale = 1.0
    if MEAN:
        scale = grad_scale(tl.load(scale_ptr))  # 0 where every row is ignored (scale = 1 / 0)
    f = tl.where(counts, scale, 0.0) + bad
    o = tl.arange(0, BLOCK)
    mc = o < C
    # base 2 (u = z log2(e)): one FMA and one ex2 an element, 18% off the kernel on an H100
    z = tl.load(row + o, mask=mc, other=float("-inf")).to(tl.float32)
    mx = tl.max(z, 0) * LOG2E
    lse2 = mx + tl.log2(tl.sum(tl.exp2(z * LOG2E - mx), 0))
    zt = tl.sum(tl.where(o == t, z, 0.0), 0)
    dz = ce_dz(z, f, lse2, o == t)
    tl.store(row + o, dz.to(z_ptr.dtype.element_ty), mask=mc)
    tl.store(loss_ptr + r, tl.where(counts, lse2 * LN2 - zt, 0.0) + bad)


@triton.jit
def row_max_sum(row, b_ptr, n, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    # over the n logits at row (plus the bias at b_ptr), read once in blocks of BLOCK, with u = (z + b) log2(e):
    # max u and the sum of 2^(u - max). A running max and sum a GROUP of lanes: one ex2 an element and one a GROUP
    o = tl.arange(0, BLOCK)
    m = tl.full([BLOCK // GROUP], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK // GROUP], dtype=tl.float32)
    for c0 in range(0, n, BLOCK):
        cols = c0 + o
        mc = cols < n
        z = tl.load(row + cols, mask=mc, other=float("-inf")).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(b_ptr + cols, mask=mc, other=0.0).to(tl.float32)
        u = tl.reshape(z * LOG2E, [BLOCK // GROUP, GROUP])
        m_new = tl.maximum(m, tl.max(u, 1))
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # a group of padding only: max -inf, sum 0
        s = s * tl.exp2(m - ref) + tl.sum(tl.exp2(u - ref[:, None]), 1)
        m = m_new
    mx = tl.max(m, 0)
    return mx, tl.sum(s * tl.exp2(m - mx), 0)


@triton.jit
def row_lse_kernel(z_ptr, b_ptr, y_ptr, scale_ptr, loss_ptr, lse_ptr, C, stride_z, ignore_index,
                   HAS_BIAS: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    # row r of the chunk (z: logits without the bias), read once in blocks of BLOCK: its base-2 lse to lse_ptr[r],
    # its gradient factor (the loss's scale, 0 if ignored, NaN for a bad id) to lse_ptr[R + r] (dz_colsum_kernel
    # reads both), its unscaled loss to loss_ptr[r]; the read is row_max_sum's. Small programs (4 warps), several
    # a SM, keep loads in flight
    r = tl.program_id(0)
    R = tl.num_programs(0)
    row = z_ptr + r.to(tl.int64) * stride_z
    t = tl.load(y_ptr + r)
    counts, bad = ce_rows(t, t == t, ignore_index, C)
    scale = 1.0
    if MEAN:
        scale = grad_scale(tl.load(scale_ptr))
    mx, sm = row_max_sum(row, b_ptr, C, HAS_BIAS, BLOCK, GROUP)
    lse2 = mx + tl.log2(sm)
    tc = tl.where(counts & (t >= 0) & (t < C), t, 0)  # the target's logit, one load (class 0's where unused)
    zt = tl.load(row + tc).to(tl.float32)
    if HAS_BIAS:
        zt += tl.load(b_ptr + tc).to(tl.float32)
    tl.store(loss_ptr + r, tl.where(counts, lse2 * LN2 - zt, 0.0) + bad)
    tl.store(lse_ptr + r, lse2)
    tl.store(lse_ptr + R + r, tl.where(counts, scale, 0.0) + bad)


@triton.jit
def dz_row_block(z_ptr, y_ptr, lse_ptr, R, stride_z, cols, classes, mc, bias, r0, r_hi, acc, HAS_BIAS: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    # dz_rows' step: rows [r0, r0 + BLOCK_R) below r_hi; returns acc plus their dz (HAS_BIAS)
    rows = r0 + tl.arange(0, BLOCK_R)
    mr = rows < r_hi
    lse2 = tl.load(lse_ptr + rows, mask=mr, other=0.0)
    f = tl.load(lse_ptr + R + rows, mask=mr, other=0.0)
    t = tl.load(y_ptr + rows, mask=mr, other=-1)
    ptrs = z_ptr + rows[:, None].to(tl.int64) * stride_z + cols[None, :]
    m = mr[:, None] & mc[None, :]
    z = tl.load(ptrs, mask=m, other=0.0).to(tl.float32) + bias[None, :]
    dz = ce_dz(z, f[:, None], lse2[:, None], classes[None, :] == t[:, None])
    tl.store(ptrs, dz.to(z_ptr.dtype.element_ty), mask=m)
    if HAS_BIAS:
        acc += tl.where(m, dz, 0.0)
    return acc


@triton.jit
def dz_rows(z_ptr, y_ptr, lse_ptr, R, stride_z, cols, classes, mc, bias, r_lo, r_hi, HAS_BIAS: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr = 0):
    # dz = f (softmax - onehot(t)) over z in place for rows [r_lo, r_hi) and z's columns cols (classes: their class
    # ids; mc: in range), from each row's base-2 lse at lse_ptr[r] and factor at lse_ptr[R + r] (row_lse_kernel's
    # outputs); returns the columns' sums of dz in fp32 before dz is rounded, rows in a fixed order (HAS_BIAS).
    # STAGES > 0: the row loop software-pipelined that deep (loads of later blocks in flight), 0: a plain loop
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    if STAGES > 0:
        for r0 in tl.range(r_lo, r_hi, BLOCK_R, num_stages=STAGES):
            acc = dz_row_block(z_ptr, y_ptr, lse_ptr, R, stride_z, cols, classes, mc, bias, r0, r_hi, acc,
                               HAS_BIAS, BLOCK_R)
    else:
        for r0 in range(r_lo, r_hi, BLOCK_R):
            acc = dz_row_block(z_ptr, y_ptr, lse_ptr, R, stride_z, cols, classes, mc, bias, r0, r_hi, acc,
                               HAS_BIAS, BLOCK_R)
    return tl.sum(acc, 0)


@triton.jit
def dz_colsum_kernel(z_ptr, b_ptr, y_ptr, lse_ptr, colsum_ptr, grad_bias_ptr, rows_loss_ptr, scale_ptr, loss_ptr,
                     R, N, C, stride_z, HAS_BIAS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                     ACCUMULATE: tl.constexpr, MEAN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # dz over z in place for a block of columns and all R rows of the chunk, from each row's base-2 lse and factor
    # (row_lse_kernel); with a bias, the column's sum of dz in fp32 (before dz is rounded), its rows in a fixed
    # order: the softmax's second read of z and the column sum's read of dz in one pass. The sums go to colsum_ptr
    # (fp32, across chunks: added from the second chunk on); the last chunk's to grad_bias in its dtype, and there
    # program 0 also sums the N rows' losses into loss_ptr: no zero-fill, copy or sum launches around the chunks
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = cols < C
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=mc, other=0.0).to(tl.float32)
    col = dz_rows(z_ptr, y_ptr, lse_ptr, R, stride_z, cols, cols, mc, bias, 0, R, HAS_BIAS, BLOCK_R, BLOCK_C)
    if HAS_BIAS:
        if not FIRST:
            col += tl.load(colsum_ptr + cols, mask=mc, other=0.0)
        if LAST:
            if ACCUMULATE:  # (as grad_bias.add_(fp32 sums): added in fp32, rounded once)
                col += tl.load(grad_bias_ptr + cols, mask=mc, other=0.0).to(tl.float32)
            tl.store(grad_bias_ptr + cols, col.to(grad_bias_ptr.dtype.element_ty), mask=mc)
        else:
            tl.store(colsum_ptr + cols, col, mask=mc)
    if LAST:
        if tl.program_id(0) == 0:
            loss_total(rows_loss_ptr, N, scale_ptr, loss_ptr, MEAN)


@triton.jit
def loss_total(rows_loss_ptr, N, scale_ptr, loss_ptr, MEAN: tl.constexpr):
    # the call's loss: its N rows' losses summed in a fixed order, times the mean's scale (1 / counted rows: a NaN
    # loss where every row is ignored, as PyTorch's)
    total = sum_vec(rows_loss_ptr, N, 1024)
    if MEAN:
        total = total * tl.load(scale_ptr)
    store_scalar(loss_ptr, total)


@triton.jit
def loss_total_kernel(rows_loss_ptr, N, scale_ptr, loss_ptr, MEAN: tl.constexpr):
    # the one-read form's loss (the two-read form's last dz_colsum_kernel takes it)
    loss_total(rows_loss_ptr, N, scale_ptr, loss_ptr, MEAN)


@triton.jit
def merge_kernel(part_ptr, y_ptr, scale_ptr, loss_ptr, lse_ptr, S, N, C, ignore_index, MEAN: tl.constexpr,
                 INIT: tl.constexpr, BLOCK: tl.constexpr):
    # rows [pid * BLOCK, +BLOCK): S splits' partial rows, [max | sum | target's logit (0 in the splits without
    # it)] each S x N, merged in order into the row's base-2 lse (lse_ptr[r]) and gradient factor (lse_ptr[N + r]:
    # the loss's scale, 0 if ignored, NaN for a bad id), and its unscaled loss (loss_ptr[r]). INIT: merged into
    # the running pair and target's logit already there (chunk_lse_kernel's, FIRST and not LAST). The splits of
    # vocab_ce_cublas_in_place.py's lse_t_kernel and of vocab_ce_lse_gemm.py's Gluon kernel
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mr = rows < N
    if INIT:
        m = tl.load(lse_ptr + rows, mask=mr, other=0.0)
        sm = tl.load(lse_ptr + N + rows, mask=mr, other=1.0)
        zt = tl.load(loss_ptr + rows, mask=mr, other=0.0)
    else:
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        sm = tl.zeros([BLOCK], dtype=tl.float32)
        zt = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, S):
        ms = tl.load(part_ptr + s * N + rows, mask=mr, other=0.0)
        ss = tl.load(part_ptr + S * N + s * N + rows, mask=mr, other=1.0)  # (masked rows: no log2(0))
        zt += tl.load(part_ptr + 2 * S * N + s * N + rows, mask=mr, other=0.0)  # (one split's, the rest 0: exact)
        mn = tl.maximum(m, ms)
        sm = sm * tl.exp2(m - mn) + ss * tl.exp2(ms - mn)
        m = mn
    t = tl.load(y_ptr + rows, mask=mr, other=ignore_index)
    counts, bad = ce_rows(t, mr, ignore_index, C)
    scale = 1.0
    if MEAN:
        scale = grad_scale(tl.load(scale_ptr))
    lse2 = m + tl.log2(sm)
    tl.store(loss_ptr + rows, tl.where(counts, lse2 * LN2 - zt, 0.0) + bad, mask=mr)
    tl.store(lse_ptr + rows, lse2, mask=mr)
    tl.store(lse_ptr + N + rows, tl.where(counts, scale, 0.0) + bad, mask=mr)


@triton.jit
def mean_scale_kernel(y_ptr, N, ignore_index, scale_ptr, BLOCK: tl.constexpr):
    # reduction="mean": 1 / the rows not ignored (inf where none is), before any chunk reads it
    n = tl.zeros([BLOCK], dtype=tl.int32)
    for i0 in range(0, N, BLOCK):
        o = i0 + tl.arange(0, BLOCK)
        n += (tl.load(y_ptr + o, mask=o < N, other=ignore_index) != ignore_index).to(tl.int32)
    store_scalar(scale_ptr, tl.math.div_rn(1.0, tl.sum(n, 0).to(tl.float32)))


def check_cublas_inputs(h, weight, bias, cfg) -> None:
    """The inputs the cublas paths (launch.CUBLAS_PATHS) take; ValueError naming what to change
    otherwise."""
    path = cfg.vocab_path or "cublas"
    if h.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"vocab_path={path!r} takes bf16 or fp32 h, got {h.dtype}: its dz is scaled before it is "
                         "rounded, which flushes a large vocabulary's fp16 gradients to zero; use vocab_path='row_chunks'")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != h.dtype:
            raise ValueError(f"vocab_path={path!r} needs {name} in h's dtype ({h.dtype}), got {t.dtype}: cuBLAS "
                             "multiplies one dtype; cast it, or use a Triton path (vocab_path=None)")
    if cfg.fp32_precision is not None:
        raise ValueError(f"fp32_precision does not apply to vocab_path={path!r}: its fp32 GEMMs follow "
                         "torch.backends.cuda.matmul.allow_tf32; leave fp32_precision=None")


def first_kernel(C: int, has_bias: bool, mean: bool, cuda: bool, two_pass: bool | None = None,
                 block: int | None = None, lse_tile: tuple | None = None) -> tuple[bool, dict]:
    """(one_read, launch keywords) of a chunk's first Triton kernel: softmax_dz_kernel where it applies (no column
    sums to take, the row fits) unless two_pass=True, else row_lse_kernel."""
    c2 = triton.next_power_of_2(C)
    fits = not has_bias and c2 <= ONE_PASS_MAX_C
    if two_pass is False and not fits:
        raise ValueError(f"two_pass=False (vocab_path='cublas': the row held, z read once) takes a head without a "
                         f"bias of at most {ONE_PASS_MAX_C} classes, got C={C}, bias={has_bias}; leave two_pass=None")
    if fits and not two_pass:
        return True, dict(MEAN=mean, BLOCK=c2, num_warps=min(16, max(8, c2 // 2048)) if cuda else 1)
    lb, lg, lw = lse_tile or (block or LSE_BLOCK, LSE_GROUP, LSE_WARPS)
    lb = min(lb, c2)
    return False, dict(HAS_BIAS=has_bias, MEAN=mean, BLOCK=lb, GROUP=min(lg, lb), num_warps=lw if cuda else 1)


class CublasCall:
    """What the cublas paths' launches share: the plan record of their first Triton kernel (`kernel`,
    `first_cx`: its launch keywords), their setup, and a call's start and buffers."""

    __slots__ = ()

    @property
    def constexprs(self) -> dict:
        """The first kernel's constexprs."""
        return {k: v for k, v in self.first_cx.items() if k != "num_warps"}

    @property
    def num_warps(self) -> int:
        return self.first_cx["num_warps"]

    def setup(self, N: int, mean: bool, ignore_index: int, has_bias: bool, device, example):
        """Sets `index`, `loss_like` and `scale_launch` (mean_scale_kernel for a mean); returns (launch, ex).
        launch(kernel, grid, cx, args) makes a KernelLaunch, compiled on CUDA for args() (a function: the
        example arguments); ex: the example's (h's dtype, bias, y, grad_bias) where they are pointers, with
        stand-ins where there is no bias (an unused pointer of z's and of the scratch's dtype); on the CPU four
        Nones (an example there is only counted)."""
        cuda = example is not None
        self.loss_like = torch.empty((), dtype=torch.float32, device=device)
        self.index = None
        ex = (None,) * 4
        if cuda:
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            hdt, bias, y, grad_bias = example
            ex = (hdt, bias if has_bias else hdt, y, grad_bias if has_bias else torch.float32)

        def launch(kernel, grid, cx, args):
            example = args()  # (on the CPU, stand-ins: only its length is checked)
            return KernelLaunch(kernel, grid, cx, example if cuda else None, len(example))

        self.scale_launch = None
        if mean:
            self.scale_launch = launch(mean_scale_kernel, 1, dict(BLOCK=1024, num_warps=4 if cuda else 1),
                                       lambda: (ex[2], N, ignore_index, torch.float32))
        return launch, ex

    def buffers(self, h, z_shape, grad_h_dtype):
        """A call's grad_h (h's shape), fp32 scratch (`n_buf`), loss and logits scratch (z_shape, h's dtype);
        under the tests' poison the first three start as NaN, so an element nobody writes shows."""
        grad_h = torch.empty(h.shape, dtype=grad_h_dtype, device=h.device)
        buf = torch.empty(self.n_buf, dtype=torch.float32, device=h.device)
        loss = torch.empty_like(self.loss_like)
        if self.poison:
            grad_h.fill_(float("nan"))
            buf.fill_(float("nan"))
            loss.fill_(float("nan"))
        return grad_h, buf, loss, torch.empty(z_shape, dtype=h.dtype, device=h.device)

    def views(self, buf, y, stream):
        """(rows' losses, lse and factor, the part up to the scale, the mean's scale: the rows' losses for a
        sum, an unused pointer) as views of a call's fp32 scratch `buf`, laid out [N | o_lse: | o_part: |
        o_scale]; the mean's scale kernel launched into its slot."""
        rows_loss = buf[:self.N]
        scale = buf[self.o_scale:] if self.mean else rows_loss
        if self.scale_launch is not None:
            self.scale_launch(stream, y, self.N, self.ignore_index, scale)
        return rows_loss, buf[self.o_lse:self.o_part], buf[self.o_part:self.o_scale], scale

    def start(self, h, y, act):
        """(h's shape, h as [N, D], y as [N], what the GEMMs read: h or relu(h), the raw CUDA stream or None).
        The CUDA fast path passes h [..., D] and y [...] as the caller gave them (the Triton kernels read only
        their pointers); torch.mm needs the [N, D] matrix. relu(h) by torch, into act when given."""
        shape = h.shape
        h, y = h.reshape(-1, shape[-1]), y.reshape(-1)
        stream = None if self.index is None else torch._C._cuda_getCurrentRawStream(self.index)
        x = h
        if self.relu:
            x = torch.clamp_min(h, 0, out=act.view(h.shape)) if act is not None else torch.clamp_min(h, 0)
        return shape, h, y, x, stream


class CublasLaunch(CublasCall):
    """One vocab_path="cublas" head call with everything but the tensors fixed; called like `plan.HeadLaunch`:
    (h, weight, bias, y, grad_weight, grad_bias, act=None) -> (loss, grad_h).

    N rows in chunks of `chunk`; `two_pass` and `block` as LaunchConfig's. lse_tile (block, group, warps) and
    dz_tile (rows, columns, warps): the two-read kernels' tiles, for tuning. example (CUDA): (h's dtype, bias, y,
    grad_bias) of the signature being prepared. Each Triton kernel is then compiled here for them and launched
    directly (kernels/direct.py): a call costs the host its cuBLAS calls and a few microseconds a Triton launch.
    Without it (the CPU interpreter), `kernel[grid](...)`."""

    __slots__ = ("N", "C", "chunk", "mean", "ignore_index", "relu", "accumulate", "has_bias", "poison", "one_read",
                 "first_cx", "index", "scale_launch", "steps", "loss_launch", "n_buf", "o_lse", "o_part", "o_scale",
                 "loss_like", "__weakref__")

    def __init__(self, N: int, C: int, chunk: int, mean: bool, ignore_index: int, relu: bool, accumulate: bool,
                 has_bias: bool, device: torch.device, poison: bool = False, two_pass: bool | None = None,
                 block: int | None = None, lse_tile: tuple | None = None, dz_tile: tuple | None = None,
                 example: tuple | None = None):
        R = min(chunk, N)
        self.N, self.C, self.chunk, self.mean, self.ignore_index, self.relu = N, C, R, mean, ignore_index, relu
        self.accumulate, self.has_bias, self.poison = accumulate, has_bias, poison
        cuda = example is not None
        self.one_read, self.first_cx = first_kernel(C, has_bias, mean, cuda, two_pass, block, lse_tile)
        br, bc, dw = dz_tile or (DZ_BLOCK_R, DZ_BLOCK_C, DZ_WARPS)
        # the fp32 scratch, one allocation: [rows' losses N | lse and factor 2R | grad_b's sums C | scale 1], each
        # part at a 16-byte boundary (what the direct launches were compiled for)
        pad = lambda n: -(-n // 4) * 4  # noqa: E731
        self.o_lse = pad(N)
        self.o_part = self.o_lse + (0 if self.one_read else pad(2 * R))  # (the part: grad_b's sums)
        self.o_scale = self.o_part + (pad(C) if has_bias else 0)
        self.n_buf = self.o_scale + 1
        launch, ex = self.setup(N, mean, ignore_index, has_bias, device, example)
        f32 = torch.float32
        hdt, b_ex, y, gb_ex = ex
        if cuda:  # the chunks' slices of y and of the rows' losses start where the whole tensors' alignment holds
            assert R == N or (R * 4 % 16 == 0 and R * y.element_size() % 16 == 0), \
                f"chunks of {R} rows would change the alignment of their slices of y and of the losses"
        built, self.steps = {}, []
        for r0 in range(0, N, R):
            r1 = min(r0 + R, N)
            first, last = r0 == 0, r1 == N
            key = (r1 - r0, first, last)
            if key not in built:
                if self.one_read:
                    a = launch(softmax_dz_kernel, r1 - r0, self.first_cx,
                               lambda: (hdt, y, f32, f32, C, C, ignore_index))
                    d = None
                else:
                    a = launch(row_lse_kernel, r1 - r0, self.first_cx,
                               lambda: (hdt, b_ex, y, f32, f32, f32, C, C, ignore_index))
                    dcx = dict(HAS_BIAS=has_bias, FIRST=first, LAST=last, ACCUMULATE=accumulate, MEAN=mean,
                               BLOCK_R=br, BLOCK_C=bc, num_warps=dw if cuda else 1)
                    d = launch(dz_colsum_kernel, -(-C // bc), dcx,  # (not triton.cdiv: a @jit function)
                               lambda n=r1 - r0: (hdt, b_ex, y, f32, f32, gb_ex, f32, f32, f32, n, N, C, C))
                built[key] = (a, d)
            self.steps.append((r0, r1) + built[key])
        self.loss_launch = None
        if self.one_read:
            self.loss_launch = launch(loss_total_kernel, 1, dict(MEAN=mean, num_warps=4 if cuda else 1),
                                      lambda: (f32, N, f32, f32))

    @property
    def kernel(self):
        """The first Triton kernel of a chunk (what plan._PLANS records)."""
        return softmax_dz_kernel if self.one_read else row_lse_kernel

    def __call__(self, h, weight, bias, y, grad_weight, grad_bias, act=None):
        shape, h, y, x, stream = self.start(h, y, act)
        N, C = self.N, self.C
        grad_h, buf, loss, z = self.buffers(h, (self.chunk, C), h.dtype)
        rows_loss, lse, colsum, scale = self.views(buf, y, stream)
        if not self.has_bias:
            bias, colsum, grad_bias = weight, lse, lse  # unused pointers (HAS_BIAS=False; not z, as below)
        wt = weight.t()
        ii = self.ignore_index
        for r0, r1, rows_k, dz_k in self.steps:
            zc = z if r1 - r0 == self.chunk else z[: r1 - r0]
            xc, yc = x[r0:r1], y[r0:r1]
            torch.mm(xc, wt, out=zc)
            if dz_k is None:  # the one-read form
                rows_k(stream, zc, yc, scale, rows_loss[r0:r1], C, C, ii)
            else:
                rows_k(stream, zc, bias, yc, scale, rows_loss[r0:r1], lse, C, C, ii)
                dz_k(stream, zc, bias, yc, lse, colsum, grad_bias, rows_loss, scale, loss, r1 - r0, N, C, C)
            torch.mm(zc, weight, out=grad_h[r0:r1])
            if r0 == 0 and not self.accumulate:
                torch.mm(zc.t(), xc, out=grad_weight)
            else:
                grad_weight.addmm_(zc.t(), xc)
        if self.loss_launch is not None:
            self.loss_launch(stream, rows_loss, N, scale, loss)
        del z, zc  # (the scratch's memory back before the ReLU's mask)
        if self.relu:
            grad_h.masked_fill_(h <= 0, 0)
        return loss, grad_h.view(shape)
