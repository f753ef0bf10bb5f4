"""Fused local head: logits = h W^T + b, the loss, grad_h, grad_W and grad_b in ONE launch.

Three kernels share one skeleton (derivation and schedule: docs/local_head.md):

* `_dense_head_kernel`  -- C <= 64 ("bce", "mse", and "ce" with few classes). A row
  tile's logits fit in registers, so dz is known after one pass over D; grad_h is
  written at once and grad_W is summed per *row group* into a private fp32 slot.
* `_small_ce_kernel`    -- "ce" with 64 < C <= 512. Phase A: per row tile, the C logits in
  registers (exact softmax), dz to an L2-resident scratch in h's dtype, grad_h = dz W.
  Phase B: the GEMM grad_W = dz^T h split over output tiles and row groups (split-K), so a
  grid of a few SMs still has work for every program; phase R sums the group rows.
* `_vocab_ce_kernel`    -- "ce" with C > 512 (vocabularies up to 128K). Phase A runs
  over row tiles with an online log-sum-exp and accumulates grad_h = softmax @ W
  flash-attention style; phase B runs over vocabulary tiles and sums grad_W from
  recomputed logits and the lse saved by phase A.

The grid is persistent and sized by `occupancy`. Programs *claim* work items from an
atomic counter; a phase ends at a grid barrier (count of finished items). Because
every claimed item belongs to a program that is already running, the barrier cannot
deadlock even when only part of the grid is resident (e.g. beside a GEMM on another
stream). Deterministic launches sum the grad_W/grad_b/loss partials in a fixed order
after the barrier, so results are bitwise reproducible. Otherwise (ATOMIC, dense kernel
with the weight in one tile) each program takes a static stride of row tiles, adds its
partials into one of ACC_COPIES zeroed fp32 accumulators with float atomics, and the last
program out sums the copies and writes the outputs: no claims, no barrier and no
reduction phase. `LaunchConfig.deterministic` chooses (None follows PyTorch's flag).

Counters live in a small per-stream int32 workspace; the last program to exit
resets them, so consecutive launches on one stream need no memset.
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig, interpreting, next_pow2, num_programs

__all__ = ["HeadLaunch", "LOSSES", "MAX_DENSE_C", "MAX_VOCAB", "prepare_launch"]

LOSSES = {"bce": 0, "ce": 1, "mse": 2}
MAX_DENSE_C = 64
# "ce" with C up to this takes the dense kernel (logits of a row tile in registers);
# above it, the vocabulary kernel. The threshold is measured (benchmarks/bench_ce_path.py).
DENSE_CE_MAX_C = 64
# "ce" with DENSE_CE_MAX_C < C <= SMALL_CE_MAX_C takes the small-vocabulary kernel (a row
# tile's C logits in registers, dz through L2 scratch, grad_W split over row groups); above
# it, the vocabulary kernel. Measured: benchmarks/bench_ce_path.py. H200 at 256 < C <= 512
# (ce_path_s9_bf16.csv, _fp32.csv; N=4096-8192, D=256-1024): bf16 1.4-3.0x faster than the
# vocabulary kernel on the whole device, 1.3-2.8x at occupancy 1/8; fp32 faster in 6 of 8
# cases (C=512 D=512 whole device 387 vs 338 us; D=256 at 1/8 a tie).
SMALL_CE_MAX_C = 512
MAX_VOCAB = 131072

# Counter slots in the int32 workspace (the kernels index ctr_ptr + slot):
#   0/1 claim/done of phase 0 (count targets), 2/3 phase A, 4/5 phase B, 6 claim of phase R,
#   7 non-ignored target count, 8 programs exited.
_N_CTR = 16


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _claim(ctr_ptr):
    # Next work item of a phase; relaxed is enough, ordering comes from the barrier.
    return tl.atomic_add(ctr_ptr, 1, sem="relaxed")


@triton.jit
def _item_done(done_ptr):
    # Every thread's stores of this item happen before the release increment.
    tl.debug_barrier()
    tl.atomic_add(done_ptr, 1, sem="release")


@triton.jit
def _wait_all(done_ptr, n_items):
    # Grid barrier over *claimed items*, safe with a partially resident grid. Spin on
    # volatile loads (reads: cheap for the L2 even with thousands of waiters), then one
    # acquire to order what follows after every item's release.
    done = tl.load(done_ptr, volatile=True)
    while done < n_items:
        done = tl.load(done_ptr, volatile=True)
    tl.atomic_add(done_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _last_out(ctr_ptr, n_programs):
    # True in the last program to get here (after every other program's writes: acq_rel).
    tl.debug_barrier()
    return tl.atomic_add(ctr_ptr + 8, 1, sem="acq_rel") == n_programs - 1


@triton.jit
def _reset(ctr_ptr, N_CTR: tl.constexpr):
    tl.store(ctr_ptr + tl.arange(0, N_CTR), tl.zeros([N_CTR], dtype=tl.int32))


@triton.jit
def _exit(ctr_ptr, n_programs, N_CTR: tl.constexpr):
    # The last program out resets every counter for the next launch on this stream.
    if _last_out(ctr_ptr, n_programs):
        _reset(ctr_ptr, N_CTR)


@triton.jit
def _count_targets(y_ptr, ctr_ptr, N, ignore_index, BLOCK: tl.constexpr):
    # Phase 0 of a mean CE: number of rows whose target is not ignore_index.
    n_items = tl.cdiv(N, BLOCK)
    item = _claim(ctr_ptr + 0)
    while item < n_items:
        o_n = tl.arange(0, BLOCK).to(tl.int64) + item * BLOCK
        b_y = tl.load(y_ptr + o_n, mask=o_n < N, other=ignore_index)
        tl.atomic_add(ctr_ptr + 7, tl.sum((b_y != ignore_index).to(tl.int32), 0), sem="relaxed")
        _item_done(ctr_ptr + 1)
        item = _claim(ctr_ptr + 0)
    _wait_all(ctr_ptr + 1, n_items)
    count = tl.atomic_add(ctr_ptr + 7, 0, sem="acquire")
    return 1.0 / count.to(tl.float32)


@triton.jit
def _ce_rows(b_t, m_n, ignore_index, C):
    # The rows of a CE tile that count (loaded, target not ignore_index), and a poison vector:
    # NaN where such a row's class id lies outside [0, C), else 0. Added to the row's loss and
    # to its gradient scale, it makes the loss and every gradient it reaches NaN, where
    # PyTorch would stop with an index error; checking the ids on the host would need a sync.
    m_row = m_n & (b_t != ignore_index)
    return m_row, tl.where(m_row & ((b_t < 0) | (b_t >= C)), float("nan"), 0.0)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    # The interpreter computes bf16/fp16 dots wrongly: upcast there (DOT_FP32). The operands must
    # share a dtype (tl.dot's rule on the GPU; asserted here so the interpreter's upcast hides no mix).
    tl.static_assert(a.dtype == b.dtype, "_dot: operands of different dtypes (cast the weight tile to h's)")
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _store_grad(p_out, val, mask, ACCUMULATE: tl.constexpr):
    # val is fp32; ACCUMULATE adds onto what the parameter's .grad already holds.
    if ACCUMULATE:
        val += tl.load(p_out, mask=mask, other=0.0).to(tl.float32)
    tl.store(p_out, val.to(p_out.dtype.element_ty), mask=mask)


@triton.jit
def _sum_vec(ptr, n, BLOCK: tl.constexpr):
    # Fixed-order sum of n fp32 values written by other programs (vector loads, not a scalar chain).
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i0 in range(0, n, BLOCK):
        o = i0 + tl.arange(0, BLOCK)
        b_acc += tl.load(ptr + o, mask=o < n, other=0.0, cache_modifier=".cg")
    return tl.sum(b_acc, axis=0)


@triton.jit
def _reduce_rows(part_ptr, stride_g, G, CD, C, gw_ptr, gb_ptr, loss_ptr, scale, r,
                 HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, WITH_LOSS: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr):
    # Group partial rows are [grad_W (C*D) | grad_b (C) | loss (1)]; column chunk r of
    # their sum over g (fixed order) goes to grad_W, grad_b and the loss.
    o_e = r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_e = o_e < CD + C + 1
    b_acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for g0 in tl.range(0, G, BLOCK_G, num_stages=3):  # several loads in flight: L2 latency, not a chain
        o_g = g0 + tl.arange(0, BLOCK_G)
        p = part_ptr + o_g.to(tl.int64)[:, None] * stride_g + o_e[None, :]
        b_acc += tl.sum(tl.load(p, mask=(o_g < G)[:, None] & m_e[None, :], other=0.0, cache_modifier=".cg"), axis=0)
    _store_grad(gw_ptr + o_e, b_acc, o_e < CD, ACCUMULATE)
    if HAS_BIAS:
        _store_grad(gb_ptr + (o_e - CD), b_acc, (o_e >= CD) & (o_e < CD + C), ACCUMULATE)
    if WITH_LOSS:
        tl.store(loss_ptr + (o_e - CD - C), b_acc * scale, mask=o_e == CD + C)


@triton.jit
def _sum_group_rows(part_ptr, stride_g, n_groups, n_b, C, D, gw_ptr, gb_ptr, loss_ptr, scale, ctr_ptr,
                    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr):
    # Phase R of the CE kernels: after phase B's n_b items (counters 4/5), the [grad_W | grad_b]
    # group rows are summed in group order, BLOCK_R columns an item (counter 6).
    _wait_all(ctr_ptr + 5, n_b)
    n_r = tl.cdiv(C * D + C, BLOCK_R)
    r = _claim(ctr_ptr + 6)
    while r < n_r:
        _reduce_rows(part_ptr, stride_g, n_groups, C * D, C, gw_ptr, gb_ptr, loss_ptr, scale, r,
                     HAS_BIAS, ACCUMULATE, False, BLOCK_G, BLOCK_R)
        r = _claim(ctr_ptr + 6)


# ----------------------------------------------------------------------- dense kernel
@triton.jit
def _relu_in(b_h, RELU: tl.constexpr):
    # the head's input is relu(h) when RELU (a no-op on an input that is already a ReLU's output)
    if RELU:
        return tl.maximum(b_h, 0.0).to(b_h.dtype)
    return b_h


@triton.jit
def _relu_out(b_g, b_h, RELU: tl.constexpr):
    # gradient at the ReLU's input: zero where relu(h) == 0 (h <= 0, torch's threshold_backward)
    if RELU:
        return tl.where(b_h > 0, b_g, 0.0)
    return b_g


@triton.jit(do_not_specialize=["N", "ignore_index", "n_tiles", "n_groups", "tiles_per_group", "n_programs"])
def _dense_head_kernel(
    h_ptr,        # [N, D] input rows (unit stride along D), fp32/bf16/fp16
    w_ptr,        # [C, D] head weight, contiguous
    b_ptr,        # [C] head bias (unused without HAS_BIAS)
    y_ptr,        # targets: float [N, C] (bce, mse) or int [N] (ce), contiguous
    gh_ptr,       # [N, D] out: grad_h, contiguous, h's dtype
    act_ptr,      # [N, D] out: relu(h), contiguous, h's dtype (STORE_ACT only)
    gw_ptr,       # [C, D] out: grad_W, weight's dtype
    gb_ptr,       # [C] out: grad_b, bias's dtype
    loss_ptr,     # [1] out: loss, fp32
    part_ptr,     # [G, stride_g] fp32 workspace: per row group [grad_W | grad_b | loss]
    acc_ptr,      # [ACC_COPIES, stride_g] fp32, zero on entry and on exit: the ATOMIC mode's accumulators
    ctr_ptr,      # [16] int32 workspace: phase counters, zero on entry and on exit
    N, D, C, stride_h, stride_g, ignore_index, inv_count,
    n_tiles, n_groups, tiles_per_group, n_programs,
    LOSS: tl.constexpr, HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, CE_MEAN: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, ATOMIC: tl.constexpr, STRIDED: tl.constexpr,
    ACC_COPIES: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, N_CTR: tl.constexpr,
    RELU: tl.constexpr, STORE_ACT: tl.constexpr = False, TWO_PASS: tl.constexpr = False,
):
    # RELU: the head reads relu(h) (every h load goes through _relu_in) and grad_h is the
    # gradient at the ReLU's input (masked where h <= 0), so the block's own ReLU backward
    # is not needed. STORE_ACT: relu(h) is also written out (for a head nothing runs beside:
    # no separate ReLU launch before it).
    if CE_MEAN:
        scale = _count_targets(y_ptr, ctr_ptr, N, ignore_index, 1024)
    else:
        scale = inv_count
    CD = C * D
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C
    if SINGLE_CHUNK:  # the whole weight fits one tile: load it once per program
        o_d1 = tl.arange(0, BLOCK_D)
        m_cd1 = m_c[:, None] & (o_d1 < D)[None, :]
        b_w1 = tl.load(w_ptr + o_c[:, None] * D + o_d1[None, :], mask=m_cd1, other=0.0)

    # ---- phase A: row groups -> grad_h, and per-group partials of grad_W, grad_b, loss
    # (ATOMIC: per-program partials, added into acc_ptr once at the end; no phase R)
    b_loss = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_gb = tl.zeros([BLOCK_C], dtype=tl.float32)
    if SINGLE_CHUNK:
        b_gw1 = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    if STRIDED:  # (ATOMIC only) program p takes tiles p, p + P, ...: no claims, one pipelined loop
        g = tl.program_id(0)
        t_step = n_programs
    else:
        g = _claim(ctr_ptr + 2)
        t_step = 1
    if TWO_PASS:  # (C = 1, one weight tile, ATOMIC + STRIDED) two passes over the program's row tiles
        # pass 1: logits, loss and dz of each tile, dz -> part_ptr [N] fp32; each tile's h is reduced
        # as it arrives and nothing is stored, so the loads pipeline freely and no tile is held across
        # the row reduction. pass 2: grad_h and grad_W from dz and h read again (from L2). The weight
        # and the grad_W partial are 1-D here ([BLOCK_D] spread over the program's threads; a [1, BLOCK_D]
        # tensor in the [BLOCK_N, BLOCK_D] tile's layout is replicated over its rows of threads).
        b_w = tl.load(w_ptr + o_d1, mask=o_d1 < D, other=0.0).to(tl.float32)
        b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for t in tl.range(tl.program_id(0), n_tiles, n_programs, num_stages=NUM_STAGES):
            o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
            m_n = o_n < N
            m_h1 = m_n[:, None] & (o_d1 < D)[None, :]
            b_h1 = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d1[None, :], mask=m_h1, other=0.0), RELU)
            b_z = tl.sum(b_h1.to(tl.float32) * b_w[None, :], axis=1)
            if HAS_BIAS:
                b_z += tl.load(b_ptr).to(tl.float32)
            b_y = tl.load(y_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
            if LOSS == 0:  # sigmoid binary cross-entropy, stable form
                b_l = tl.maximum(b_z, 0.0) - b_z * b_y + tl.log(1.0 + tl.exp(-tl.abs(b_z)))
                b_dz = (1.0 / (1.0 + tl.exp(-b_z)) - b_y) * scale
            else:  # squared error
                b_l = (b_z - b_y) * (b_z - b_y)
                b_dz = 2.0 * (b_z - b_y) * scale
            b_loss += tl.where(m_n, b_l, 0.0)
            b_dz = tl.where(m_n, b_dz, 0.0)
            b_gb += tl.sum(b_dz, axis=0)
            tl.store(part_ptr + o_n, b_dz, mask=m_n)
        tl.debug_barrier()  # this program's dz stores are visible to all its threads
        for t in tl.range(tl.program_id(0), n_tiles, n_programs, num_stages=NUM_STAGES):
            o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
            m_n = o_n < N
            m_h1 = m_n[:, None] & (o_d1 < D)[None, :]
            b_dz = tl.load(part_ptr + o_n, mask=m_n, other=0.0)
            b_h1 = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d1[None, :], mask=m_h1, other=0.0), RELU)
            if STORE_ACT:
                tl.store(act_ptr + o_n[:, None] * D + o_d1[None, :], b_h1, mask=m_h1)
            b_gh = b_dz[:, None] * b_w[None, :]
            b_acc += tl.sum(b_dz[:, None] * b_h1.to(tl.float32), axis=0)
            tl.store(gh_ptr + o_n[:, None] * D + o_d1[None, :], _relu_out(b_gh, b_h1, RELU).to(gh_ptr.dtype.element_ty),
                     mask=m_h1)
        b_gw1 = b_acc[None, :]
    else:  # (a constexpr branch: the grouped loop's ~195 registers stay out of the two-pass binary)
        while g < n_groups:
            if STRIDED:
                t_lo = g
                t_hi = n_tiles
            else:
                t_lo = g * tiles_per_group
                t_hi = tl.minimum(t_lo + tiles_per_group, n_tiles)
            p_row = part_ptr + g.to(tl.int64) * stride_g
            if not ATOMIC:
                b_loss = tl.zeros([BLOCK_N], dtype=tl.float32)
                b_gb = tl.zeros([BLOCK_C], dtype=tl.float32)
                if SINGLE_CHUNK:
                    b_gw1 = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
            for t in tl.range(t_lo, t_hi, t_step, num_stages=NUM_STAGES):
                o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
                m_n = o_n < N
                # pass 1: logits z [BLOCK_N, BLOCK_C]
                if SINGLE_CHUNK:
                    m_h1 = m_n[:, None] & (o_d1 < D)[None, :]
                    b_h1 = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d1[None, :], mask=m_h1, other=0.0), RELU)
                    if STORE_ACT:
                        tl.store(act_ptr + o_n[:, None] * D + o_d1[None, :], b_h1, mask=m_h1)
                    if BLOCK_C == 1:
                        b_z = tl.sum(b_h1.to(tl.float32) * b_w1.to(tl.float32), axis=1)[:, None]
                    else:
                        b_z = _dot(b_h1, tl.trans(b_w1).to(b_h1.dtype), DOT_FP32, PRECISION)
                else:
                    b_z = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
                    for d0 in range(0, D, BLOCK_D):
                        o_d = d0 + tl.arange(0, BLOCK_D)
                        m_d = o_d < D
                        b_h = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d[None, :], mask=m_n[:, None] & m_d[None, :],
                                               other=0.0), RELU)
                        if STORE_ACT:
                            tl.store(act_ptr + o_n[:, None] * D + o_d[None, :], b_h, mask=m_n[:, None] & m_d[None, :])
                        b_w = tl.load(w_ptr + o_c[:, None] * D + o_d[None, :], mask=m_c[:, None] & m_d[None, :], other=0.0)
                        if BLOCK_C == 1:
                            b_z += tl.sum(b_h.to(tl.float32) * b_w.to(tl.float32), axis=1)[:, None]
                        else:
                            b_z += _dot(b_h, tl.trans(b_w).to(b_h.dtype), DOT_FP32, PRECISION)
                if HAS_BIAS:
                    b_z += tl.load(b_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
                m_nc = m_n[:, None] & m_c[None, :]
                # loss and dz = dLoss/dz, [BLOCK_N, BLOCK_C]
                if LOSS == 1:  # softmax cross-entropy over C classes
                    b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
                    m_row, b_bad = _ce_rows(b_t, m_n, ignore_index, C)
                    b_zm = tl.where(m_c[None, :], b_z, float("-inf"))
                    b_max = tl.max(b_zm, axis=1)
                    b_e = tl.exp(b_zm - b_max[:, None])
                    b_s = tl.sum(b_e, axis=1)
                    b_hot = o_c[None, :] == b_t[:, None]
                    b_zt = tl.sum(tl.where(b_hot, b_z, 0.0), axis=1)
                    b_loss += tl.where(m_row, b_max + tl.log(b_s) - b_zt, 0.0) + b_bad
                    b_dz = (b_e / b_s[:, None] - b_hot.to(tl.float32)) * (tl.where(m_row, scale, 0.0) + b_bad)[:, None]
                else:
                    b_y = tl.load(y_ptr + o_n[:, None] * C + o_c[None, :], mask=m_nc, other=0.0).to(tl.float32)
                    if LOSS == 0:  # sigmoid binary cross-entropy, stable form
                        b_l = tl.maximum(b_z, 0.0) - b_z * b_y + tl.log(1.0 + tl.exp(-tl.abs(b_z)))
                        b_dz = (1.0 / (1.0 + tl.exp(-b_z)) - b_y) * scale
                    else:  # squared error
                        b_l = (b_z - b_y) * (b_z - b_y)
                        b_dz = 2.0 * (b_z - b_y) * scale
                    b_loss += tl.sum(tl.where(m_nc, b_l, 0.0), axis=1)
                    b_dz = tl.where(m_nc, b_dz, 0.0)
                b_gb += tl.sum(b_dz, axis=0)
                # pass 2: grad_h = dz W, group partial of grad_W += dz^T h
                if SINGLE_CHUNK:
                    if BLOCK_C == 1:
                        b_gh = b_dz * b_w1.to(tl.float32)
                        b_gw1 += tl.sum(b_dz * b_h1.to(tl.float32), axis=0)[None, :]
                    else:
                        b_gh = _dot(b_dz.to(b_h1.dtype), b_w1.to(b_h1.dtype), DOT_FP32, PRECISION)
                        b_gw1 += _dot(tl.trans(b_dz).to(b_h1.dtype), b_h1, DOT_FP32, PRECISION)
                    tl.store(gh_ptr + o_n[:, None] * D + o_d1[None, :], _relu_out(b_gh, b_h1, RELU).to(gh_ptr.dtype.element_ty),
                             mask=m_h1)
                else:
                    first = t == t_lo
                    for d0 in range(0, D, BLOCK_D):
                        o_d = d0 + tl.arange(0, BLOCK_D)
                        m_d = o_d < D
                        m_cd = m_c[:, None] & m_d[None, :]
                        b_h = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d[None, :], mask=m_n[:, None] & m_d[None, :],
                                               other=0.0), RELU)
                        b_w = tl.load(w_ptr + o_c[:, None] * D + o_d[None, :], mask=m_cd, other=0.0)
                        if BLOCK_C == 1:
                            b_gh = b_dz * b_w.to(tl.float32)
                            b_gw = tl.sum(b_dz * b_h.to(tl.float32), axis=0)[None, :]
                        else:
                            b_gh = _dot(b_dz.to(b_h.dtype), b_w.to(b_h.dtype), DOT_FP32, PRECISION)
                            b_gw = _dot(tl.trans(b_dz).to(b_h.dtype), b_h, DOT_FP32, PRECISION)
                        tl.store(gh_ptr + o_n[:, None] * D + o_d[None, :], _relu_out(b_gh, b_h, RELU).to(gh_ptr.dtype.element_ty),
                                 mask=m_n[:, None] & m_d[None, :])
                        p_part = p_row + o_c[:, None] * D + o_d[None, :]
                        if not first:
                            b_gw += tl.load(p_part, mask=m_cd, other=0.0)
                        tl.store(p_part, b_gw, mask=m_cd)
            if not ATOMIC:
                if SINGLE_CHUNK:
                    tl.store(p_row + o_c[:, None] * D + o_d1[None, :], b_gw1, mask=m_cd1)
                tl.store(p_row + CD + o_c, b_gb, mask=m_c)
                tl.store(p_row + CD + C + tl.arange(0, 1), tl.sum(b_loss, axis=0) + tl.zeros([1], dtype=tl.float32))
                _item_done(ctr_ptr + 3)
            if STRIDED:
                g = n_groups
            else:
                g = _claim(ctr_ptr + 2)

    if ATOMIC:  # (SINGLE_CHUNK only) float atomics: the sum's order follows program timing
        # ACC_COPIES accumulators (stride_g apart) split the programs' atomics on each address
        p_acc = acc_ptr + (tl.program_id(0) % ACC_COPIES) * stride_g
        tl.atomic_add(p_acc + o_c[:, None] * D + o_d1[None, :], b_gw1, mask=m_cd1, sem="relaxed")
        tl.atomic_add(p_acc + CD + o_c, b_gb, mask=m_c, sem="relaxed")
        tl.atomic_add(p_acc + CD + C, tl.sum(b_loss, axis=0), sem="relaxed")
        # The last program out sums the copies, writes the outputs, and re-zeroes acc and counters.
        if _last_out(ctr_ptr, n_programs):
            tl.debug_barrier()
            for r in range(0, tl.cdiv(CD + C + 1, BLOCK_R)):
                _reduce_rows(acc_ptr, stride_g, ACC_COPIES, CD, C, gw_ptr, gb_ptr, loss_ptr, scale, r,
                             HAS_BIAS, ACCUMULATE, True, ACC_COPIES, BLOCK_R)
                o_f = r * BLOCK_R + tl.arange(0, BLOCK_R)
                for k in tl.static_range(ACC_COPIES):
                    tl.store(acc_ptr + k * stride_g + o_f, tl.zeros([BLOCK_R], dtype=tl.float32),
                             mask=o_f < CD + C + 1)
            _reset(ctr_ptr, N_CTR)
    else:
        _wait_all(ctr_ptr + 3, n_groups)
        # ---- phase R: fixed-order sums of the group rows -> grad_W, grad_b, loss
        n_r = tl.cdiv(CD + C + 1, BLOCK_R)
        r = _claim(ctr_ptr + 6)
        while r < n_r:
            _reduce_rows(part_ptr, stride_g, n_groups, CD, C, gw_ptr, gb_ptr, loss_ptr, scale, r,
                         HAS_BIAS, ACCUMULATE, True, BLOCK_G, BLOCK_R)
            r = _claim(ctr_ptr + 6)
        _exit(ctr_ptr, n_programs, N_CTR)


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, o_n, m_n, o_v, m_v, D, stride_h, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, RELU: tl.constexpr):
    # z = h[o_n] W[o_v]^T + b[o_v], fp32 [BLOCK_N, BLOCK_V], accumulated over K chunks of D
    b_z = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < D
        b_h = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                               other=0.0), RELU)
        b_w = tl.load(w_ptr + o_v.to(tl.int64)[:, None] * D + o_k[None, :], mask=m_v[:, None] & m_k[None, :], other=0.0)
        b_z += _dot(b_h, tl.trans(b_w).to(b_h.dtype), DOT_FP32, PRECISION)
    if HAS_BIAS:
        b_z += tl.load(b_ptr + o_v, mask=m_v, other=0.0).to(tl.float32)[None, :]
    return b_z


# ------------------------------------------------------------------ vocabulary CE kernel
@triton.jit(do_not_specialize=["N", "ignore_index", "n_tiles", "n_groups", "tiles_per_group", "n_programs"])
def _vocab_ce_kernel(
    h_ptr,        # [N, D] input rows (unit stride along D)
    w_ptr,        # [C, D] head weight, contiguous
    b_ptr,        # [C] head bias (unused without HAS_BIAS)
    y_ptr,        # [N] int targets (ignore_index skips a row)
    gh_ptr,       # [N, D] out: grad_h, contiguous, h's dtype
    act_ptr,      # [N, D] out: relu(h), contiguous, h's dtype (STORE_ACT only)
    gw_ptr,       # [C, D] out: grad_W, weight's dtype
    gb_ptr,       # [C] out: grad_b
    loss_ptr,     # [1] out: loss, fp32
    ws_ptr,       # fp32 workspace: lse [N] | loss per row tile [n_tiles] | group rows [G, stride_g] (G > 1)
    acc_ptr,      # unused here (the dense kernel's ATOMIC accumulator; same launch signature)
    ctr_ptr,      # [16] int32 workspace: phase counters, zero on entry and on exit
    N, D, C, stride_h, stride_g, ignore_index, inv_count,
    n_tiles, n_groups, tiles_per_group, n_programs,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, CE_MEAN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DC: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    N_CTR: tl.constexpr, RELU: tl.constexpr,
):
    if CE_MEAN:
        scale = _count_targets(y_ptr, ctr_ptr, N, ignore_index, 1024)
    else:
        scale = inv_count
    lse_ptr = ws_ptr
    part_l_ptr = ws_ptr + N
    part_ptr = ws_ptr + N + n_tiles
    n_dc = tl.cdiv(D, BLOCK_DC)
    n_v = tl.cdiv(C, BLOCK_V)

    # ---- phase A: (row tile, D chunk) -> lse, loss, grad_h = scale*(softmax(z) W - W[t])
    n_a = n_tiles * n_dc
    item = _claim(ctr_ptr + 2)
    while item < n_a:
        t = item // n_dc
        dc = item % n_dc
        o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
        m_n = o_n < N
        o_dc = dc * BLOCK_DC + tl.arange(0, BLOCK_DC)
        m_dc = o_dc < D
        b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
        m_row, b_bad = _ce_rows(b_t, m_n, ignore_index, C)
        b_m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        b_s = tl.zeros([BLOCK_N], dtype=tl.float32)
        b_zt = tl.zeros([BLOCK_N], dtype=tl.float32)
        b_acc = tl.zeros([BLOCK_N, BLOCK_DC], dtype=tl.float32)
        for v0 in range(0, C, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            m_v = o_v < C
            b_z = _logits_tile(h_ptr, w_ptr, b_ptr, o_n, m_n, o_v, m_v, D, stride_h,
                               HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32, PRECISION, RELU)
            b_z = tl.where(m_v[None, :], b_z, float("-inf"))
            b_zt += tl.sum(tl.where(o_v[None, :] == b_t[:, None], b_z, 0.0), axis=1)
            b_mnew = tl.maximum(b_m, tl.max(b_z, axis=1))
            b_alpha = tl.exp(b_m - b_mnew)
            b_p = tl.exp(b_z - b_mnew[:, None])
            b_s = b_s * b_alpha + tl.sum(b_p, axis=1)
            b_wd = tl.load(w_ptr + o_v.to(tl.int64)[:, None] * D + o_dc[None, :], mask=m_v[:, None] & m_dc[None, :], other=0.0)
            b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_wd.dtype), b_wd, DOT_FP32, PRECISION)
            b_m = b_mnew
        b_lse = b_m + tl.log(b_s)
        m_id = m_row & (b_t >= 0) & (b_t < C)  # the gather W[t] reads only in-range rows
        b_wt = tl.load(w_ptr + b_t.to(tl.int64)[:, None] * D + o_dc[None, :], mask=m_id[:, None] & m_dc[None, :], other=0.0)
        b_gh = (tl.where(m_row, scale, 0.0) + b_bad)[:, None] * (b_acc / b_s[:, None] - b_wt.to(tl.float32))
        if RELU:
            b_gh = _relu_out(b_gh, tl.load(h_ptr + o_n[:, None] * stride_h + o_dc[None, :],
                                           mask=m_n[:, None] & m_dc[None, :], other=0.0), RELU)
        tl.store(gh_ptr + o_n[:, None] * D + o_dc[None, :], b_gh.to(gh_ptr.dtype.element_ty), mask=m_n[:, None] & m_dc[None, :])
        if dc == 0:
            tl.store(lse_ptr + o_n, b_lse, mask=m_n)
            tl.store(part_l_ptr + t + tl.arange(0, 1),
                     tl.sum(tl.where(m_row, b_lse - b_zt, 0.0) + b_bad, axis=0) + tl.zeros([1], dtype=tl.float32))
        _item_done(ctr_ptr + 3)
        item = _claim(ctr_ptr + 2)
    _wait_all(ctr_ptr + 3, n_a)

    # ---- phase B: (vocab tile, row group, D chunk) -> grad_W, grad_b (or group rows)
    n_b = n_v * n_groups * n_dc
    item = _claim(ctr_ptr + 4)
    while item < n_b:
        if item == 0:
            tl.store(loss_ptr + tl.arange(0, 1), _sum_vec(part_l_ptr, n_tiles, 1024) * scale + tl.zeros([1], dtype=tl.float32))
        v = item // (n_groups * n_dc)
        g = (item // n_dc) % n_groups
        dc = item % n_dc
        o_v = v * BLOCK_V + tl.arange(0, BLOCK_V)
        m_v = o_v < C
        o_dc = dc * BLOCK_DC + tl.arange(0, BLOCK_DC)
        m_dc = o_dc < D
        b_acc = tl.zeros([BLOCK_V, BLOCK_DC], dtype=tl.float32)
        b_gb = tl.zeros([BLOCK_V], dtype=tl.float32)
        t_lo = g * tiles_per_group
        t_hi = tl.minimum(t_lo + tiles_per_group, n_tiles)
        for t in range(t_lo, t_hi):
            o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
            m_n = o_n < N
            b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
            m_row, b_bad = _ce_rows(b_t, m_n, ignore_index, C)
            b_lse = tl.load(lse_ptr + o_n, mask=m_n, other=0.0, cache_modifier=".cg")
            b_z = _logits_tile(h_ptr, w_ptr, b_ptr, o_n, m_n, o_v, m_v, D, stride_h,
                               HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32, PRECISION, RELU)
            b_dz = tl.exp(b_z - b_lse[:, None]) - (o_v[None, :] == b_t[:, None]).to(tl.float32)
            b_dz = tl.where(m_row[:, None] & m_v[None, :], b_dz * (scale + b_bad)[:, None], 0.0)
            b_hd = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_dc[None, :], mask=m_n[:, None] & m_dc[None, :],
                                    other=0.0), RELU)
            b_acc += _dot(tl.trans(b_dz).to(b_hd.dtype), b_hd, DOT_FP32, PRECISION)
            b_gb += tl.sum(b_dz, axis=0)
        o_w = o_v.to(tl.int64)[:, None] * D + o_dc[None, :]
        m_w = m_v[:, None] & m_dc[None, :]
        if n_groups == 1:
            _store_grad(gw_ptr + o_w, b_acc, m_w, ACCUMULATE)
            if HAS_BIAS:
                if dc == 0:
                    _store_grad(gb_ptr + o_v, b_gb, m_v, ACCUMULATE)
        else:
            p_row = part_ptr + g.to(tl.int64) * stride_g
            tl.store(p_row + o_w, b_acc, mask=m_w)
            if dc == 0:
                tl.store(p_row + C * D + o_v, b_gb, mask=m_v)
        _item_done(ctr_ptr + 5)
        item = _claim(ctr_ptr + 4)

    # ---- phase R (only with several row groups): fixed-order sum over groups
    if n_groups > 1:
        _sum_group_rows(part_ptr, stride_g, n_groups, n_b, C, D, gw_ptr, gb_ptr, loss_ptr, scale, ctr_ptr,
                        HAS_BIAS, ACCUMULATE, BLOCK_G, BLOCK_R)
    _exit(ctr_ptr, n_programs, N_CTR)


# ------------------------------------------------------------------ small-vocabulary CE kernel
@triton.jit(do_not_specialize=["N", "ignore_index", "n_tiles", "n_groups", "tiles_per_group", "n_programs"])
def _small_ce_kernel(
    h_ptr,        # [N, D] input rows (unit stride along D)
    w_ptr,        # [C, D] head weight, contiguous
    b_ptr,        # [C] head bias (unused without HAS_BIAS)
    y_ptr,        # [N] int targets (ignore_index skips a row)
    gh_ptr,       # [N, D] out: grad_h, contiguous, h's dtype
    act_ptr,      # [N, D] out: relu(h), contiguous, h's dtype (STORE_ACT only)
    gw_ptr,       # [C, D] out: grad_W, weight's dtype
    gb_ptr,       # [C] out: grad_b
    loss_ptr,     # [1] out: loss, fp32
    ws_ptr,       # fp32 workspace: loss per row tile [n_tiles, padded] | group rows [G, stride_g] (G > 1)
                  #                 | dz [N, BLOCK_C] in h's dtype
    acc_ptr,      # unused here (same launch signature as the other kernels)
    ctr_ptr,      # [16] int32 workspace: phase counters, zero on entry and on exit
    N, D, C, stride_h, stride_g, ignore_index, inv_count,
    n_tiles, n_groups, tiles_per_group, n_programs,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, CE_MEAN: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DC: tl.constexpr,
    BLOCK_CW: tl.constexpr, BLOCK_DW: tl.constexpr, BLOCK_KW: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    N_CTR: tl.constexpr, PHASES: tl.constexpr, RELU: tl.constexpr, GH_T: tl.constexpr = False,
    STORE_ACT: tl.constexpr = False,
):
    # C <= 512: a row tile's logits fit in registers, so the softmax is exact in one pass (no
    # online max, no recomputed logits). Phase A: per row tile, z = h W^T (pipelined over D),
    # the loss, dz = dLoss/dz (to an L2-resident scratch in h's dtype) and grad_h = dz W.
    # Phase B: the GEMM grad_W = dz^T h, split over output tiles AND row groups (split-K), so
    # every program has work even at low occupancy; with several groups, phase R sums the
    # group rows in a fixed order. Deterministic: no float atomics. PHASES < 3 stops early
    # (A only, or A and B): a profiling knob for timing the phases by difference.
    if CE_MEAN:
        scale = _count_targets(y_ptr, ctr_ptr, N, ignore_index, 1024)
    else:
        scale = inv_count
    part_l_ptr = ws_ptr
    part_ptr = ws_ptr + tl.cdiv(n_tiles, 16) * 16
    n_gr = tl.where(n_groups > 1, n_groups, 0)
    dz_ptr = (part_ptr + n_gr.to(tl.int64) * stride_g).to(tl.pointer_type(gh_ptr.dtype.element_ty))
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C

    # ---- phase A: row tiles -> loss partial, dz, grad_h
    # Each program claims its next item when it starts one, so the claim's round trip to
    # L2 overlaps the item's work instead of preceding the next one.
    t = _claim(ctr_ptr + 2)
    while t < n_tiles:
        t_next = _claim(ctr_ptr + 2)
        o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
        m_n = o_n < N
        b_z = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for k0 in tl.range(0, D, BLOCK_K, num_stages=NUM_STAGES):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < D
            b_h = _relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                                   other=0.0), RELU)
            if STORE_ACT:
                tl.store(act_ptr + o_n[:, None] * D + o_k[None, :], b_h, mask=m_n[:, None] & m_k[None, :])
            b_w = tl.load(w_ptr + o_c[:, None] * D + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0.0)
            b_z += _dot(b_h, tl.trans(b_w).to(b_h.dtype), DOT_FP32, PRECISION)
        # padded columns (c >= C) get -inf, with the bias in one vector add
        if HAS_BIAS:
            b_z += tl.load(b_ptr + o_c, mask=m_c, other=float("-inf")).to(tl.float32)[None, :]
        else:
            b_z += tl.where(m_c, 0.0, float("-inf"))[None, :]
        # one [BLOCK_N, BLOCK_C] fp32 tile live at a time (z, then e, then dz)
        b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
        m_row, b_bad = _ce_rows(b_t, m_n, ignore_index, C)
        b_zt = tl.sum(tl.where(o_c[None, :] == b_t[:, None], b_z, 0.0), axis=1)
        b_max = tl.max(b_z, axis=1)
        b_z = tl.exp(b_z - b_max[:, None])
        b_s = tl.sum(b_z, axis=1)
        tl.store(part_l_ptr + t + tl.arange(0, 1),
                 tl.sum(tl.where(m_row, b_max + tl.log(b_s) - b_zt, 0.0) + b_bad, axis=0) + tl.zeros([1], dtype=tl.float32))
        b_r = tl.where(m_row, scale, 0.0) + b_bad
        b_dz = (b_z * (b_r / b_s)[:, None] - tl.where(o_c[None, :] == b_t[:, None], b_r[:, None], 0.0)).to(gh_ptr.dtype.element_ty)
        # dz rows are BLOCK_C wide (padded columns hold zeros): unmasked, aligned loads in phase B
        tl.store(dz_ptr + o_n[:, None] * BLOCK_C + o_c[None, :], b_dz, mask=m_n[:, None])
        if GH_T:
            b_dzt = tl.trans(b_dz)
        for d0 in tl.range(0, D, BLOCK_DC, num_stages=NUM_STAGES):
            o_d = d0 + tl.arange(0, BLOCK_DC)
            m_d = o_d < D
            if GH_T:
                b_wt = tl.load(w_ptr + o_c[None, :] * D + o_d[:, None], mask=m_c[None, :] & m_d[:, None], other=0.0)
                b_gh = tl.trans(_dot(b_wt.to(b_dz.dtype), b_dzt, DOT_FP32, PRECISION))
            else:
                b_w = tl.load(w_ptr + o_c[:, None] * D + o_d[None, :], mask=m_c[:, None] & m_d[None, :], other=0.0)
                b_gh = _dot(b_dz, b_w.to(b_dz.dtype), DOT_FP32, PRECISION)
            if RELU:
                b_gh = _relu_out(b_gh, tl.load(h_ptr + o_n[:, None] * stride_h + o_d[None, :],
                                               mask=m_n[:, None] & m_d[None, :], other=0.0), RELU)
            tl.store(gh_ptr + o_n[:, None] * D + o_d[None, :], b_gh.to(gh_ptr.dtype.element_ty),
                     mask=m_n[:, None] & m_d[None, :])
        _item_done(ctr_ptr + 3)
        t = t_next
    _wait_all(ctr_ptr + 3, n_tiles)

    if PHASES > 1:
        # ---- phase B: (output tile [BLOCK_CW, BLOCK_DW], row group) -> grad_W = dz^T h, grad_b
        n_dw = tl.cdiv(D, BLOCK_DW)
        n_b = tl.cdiv(C, BLOCK_CW) * n_dw * n_groups
        item = _claim(ctr_ptr + 4)
        while item < n_b:
            item_next = _claim(ctr_ptr + 4)
            if item == 0:
                tl.store(loss_ptr + tl.arange(0, 1), _sum_vec(part_l_ptr, n_tiles, 1024) * scale + tl.zeros([1], dtype=tl.float32))
            g = item % n_groups
            tile = item // n_groups
            dw = tile % n_dw
            o_v = (tile // n_dw) * BLOCK_CW + tl.arange(0, BLOCK_CW)
            m_v = o_v < C
            o_d = dw * BLOCK_DW + tl.arange(0, BLOCK_DW)
            m_d = o_d < D
            b_acc = tl.zeros([BLOCK_CW, BLOCK_DW], dtype=tl.float32)
            b_gb = tl.zeros([BLOCK_KW, BLOCK_CW], dtype=tl.float32)  # grad_b, summed over rows once at the end
            r_lo = g * tiles_per_group * BLOCK_KW
            r_hi = tl.minimum(r_lo + tiles_per_group * BLOCK_KW, N)
            for r0 in tl.range(r_lo, r_hi, BLOCK_KW, num_stages=NUM_STAGES):
                o_r = r0 + tl.arange(0, BLOCK_KW).to(tl.int64)
                m_r = o_r < N
                b_dz = tl.load(dz_ptr + o_r[:, None] * BLOCK_C + o_v[None, :], mask=m_r[:, None], other=0.0,
                               cache_modifier=".cg")
                b_hd = _relu_in(tl.load(h_ptr + o_r[:, None] * stride_h + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                                        other=0.0), RELU)
                b_acc += _dot(tl.trans(b_dz), b_hd.to(b_dz.dtype), DOT_FP32, PRECISION)
                if HAS_BIAS:  # elementwise: a sum over rows here is a cross-warp reduction an iteration
                    b_gb += b_dz.to(tl.float32)
            o_w = o_v.to(tl.int64)[:, None] * D + o_d[None, :]
            m_w = m_v[:, None] & m_d[None, :]
            # (the group row's address is written out at each store: hoisting it into a variable
            # gives the fp32 variant 12-28 bytes of spills, compile_report.py)
            if n_groups == 1:
                _store_grad(gw_ptr + o_w, b_acc, m_w, ACCUMULATE)
            else:
                tl.store(part_ptr + g.to(tl.int64) * stride_g + o_w, b_acc, mask=m_w)
            if HAS_BIAS:
                if dw == 0:
                    if n_groups == 1:
                        _store_grad(gb_ptr + o_v, tl.sum(b_gb, axis=0), m_v, ACCUMULATE)
                    else:
                        tl.store(part_ptr + g.to(tl.int64) * stride_g + C * D + o_v, tl.sum(b_gb, axis=0), mask=m_v)
            _item_done(ctr_ptr + 5)
            item = item_next

        # ---- phase R (only with several row groups): fixed-order sum over groups
        if PHASES > 2:
            if n_groups > 1:
                _sum_group_rows(part_ptr, stride_g, n_groups, n_b, C, D, gw_ptr, gb_ptr, loss_ptr, scale, ctr_ptr,
                                HAS_BIAS, ACCUMULATE, BLOCK_G, BLOCK_R)
    _exit(ctr_ptr, n_programs, N_CTR)


# ------------------------------------------------------------------------------ launcher
class _Workspace:
    """Per-(device, stream) scratch: zeroed int32 counters, a grow-only fp32 buffer, and a
    grow-only fp32 accumulator that every launch leaves at zero (the ATOMIC mode's).

    Launches on one stream are ordered, so they may share it; launches on other
    streams get their own. The kernel leaves the counters at zero.
    """

    def __init__(self, device):
        self.ctr = torch.zeros(_N_CTR, dtype=torch.int32, device=device)
        self.buf = torch.empty(0, dtype=torch.float32, device=device)
        self.acc = torch.zeros(0, dtype=torch.float32, device=device)  # kept zero by the kernel

    def floats(self, n: int) -> torch.Tensor:
        if self.buf.numel() < n:
            self.buf = torch.empty(max(n, 2 * self.buf.numel()), dtype=torch.float32, device=self.ctr.device)
        return self.buf

    def zeros(self, n: int) -> torch.Tensor:
        if self.acc.numel() < n:
            self.acc = torch.zeros(max(n, 2 * self.acc.numel()), dtype=torch.float32, device=self.ctr.device)
        return self.acc


_WORKSPACES: dict = {}
# Tests set this: library-allocated outputs and scratch start as NaN, so an element
# the kernel forgets to write (or reads before writing) fails loudly.
POISON = False


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _workspace(device: torch.device) -> _Workspace:
    if device.type == "cuda":
        index = _device_index(device)
        key = (index, torch._C._cuda_getCurrentRawStream(index))
    else:
        key = (device.type, None)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = _Workspace(device)
    return ws


def _dense_blocks(D: int, C: int, cfg: LaunchConfig, cuda: bool, deterministic: bool, esize: int) -> dict:
    """Tiles, warps and reduction mode of the dense kernel for h rows of D elements of esize bytes."""
    dp = next_pow2(D)
    block_c = 1 if C == 1 else max(16, next_pow2(C))
    if cfg.block_d:
        bd = cfg.block_d
    elif block_c * dp <= 8192 and (dp <= 1024 or (block_c == 1 and dp <= 4096)):
        # whole rows in one tile: h is read once (two passes over D-chunks read it twice), W once
        # per program. C=1 keeps whole rows up to D=4096 (4 or 2 rows a tile: the same 8192
        # elements as 8 rows of 1024); session 13 measured D=2048 (tune_dense_head_s13*.csv).
        bd = max(dp, 16)
    else:
        bd = 128
    rows_c1 = bd >= D and block_c == 1 and bd >= 512  # long whole rows, no tl.dot: a bandwidth-bound stream
    maxnreg = None  # ptxas' register cap (LaunchConfig.max_registers overrides)
    if rows_c1:
        # H200 tile study (benchmarks/results/tune_dense_head.csv, BCE N=65536 D=1024 bf16):
        # 8 rows x 1024 on 2 warps, two-stage pipelined row loop: 81 µs vs 107 µs for the
        # previous 16 rows on 4 warps, unpipelined. At most 8 rows: at D=512, 8 rows (64 h
        # elements a thread) beat 16 (side_head_tiles.csv, N=4096: 19.3 -> 15.0 µs at 1/8,
        # 8.4 -> 7.5 µs whole device, bf16; tf32 20.5 -> 14.6 and 9.5 -> 9.2).
        # fp32 rows of 2048+: half the tile on 4 warps, unpipelined (32 h elements a thread).
        # H200, BCE N=16384 (tune_dense_head_s13b_fp32.csv): D=2048 73.3 vs 80.0 µs (N=4096:
        # 23.5 vs 26.1), D=4096 145.8 vs 159.3; bf16 keeps 8192-element tiles (43.3 vs 44.6 µs).
        half = esize == 4 and bd >= 2048
        bn = cfg.block_n or max(1, min(8, (4096 if half else 8192) // bd))
        warps, stages = (4, 1) if half else (2, 2)
        # Beside another stream (occupancy < 1) a program's row tiles run as a dependent chain, and
        # its length is N / (rows a tile x programs); ptxas' default of ~200 registers a thread fits
        # 5 programs an SM. Capped at 128 (some spills), 8 fit: H200, 8 x 512 tiles at 1/8
        # (side_head_regs_s14e.csv): N=4096 tf32 15.1 -> 10.8 µs, bf16 15.3 -> 11.1, N=1024 tf32
        # 6.8 -> 5.8. The whole device gains nothing (one tile a program already). Measured at D=512.
        # fp32 only: in the graphed MLP w512 step (sched_s14f) the capped bf16 side heads made the
        # step 1.5-4.5% slower (fused / PyTorch heads b1024 1.21 -> 1.15, b4096 with the ReLU in
        # the head 1.13 -> 1.08), while tf32 held or gained (b4096, ReLU in the head, 1.14 -> 1.16).
        if esize == 4 and bd == 512 and cfg.occupancy is not None and cfg.occupancy < 1:
            maxnreg = 128  # (CUDA launches only: `_plan` and `stream_head` drop it under the interpreter)
    elif bd >= D and block_c == 1:
        # short whole rows (launch-bound sizes): more, smaller tiles, unpipelined. H200 study:
        # N=1024 D=128 7.1 µs at 32 rows vs 12.0 µs at 128 rows; D=256 7.7 vs 13.9 µs at 16 vs 64
        # rows. A two-stage loop costs 45-66 µs there (one tile a program: nothing to overlap).
        bn = cfg.block_n or max(16, min(128, 4096 // bd))
        warps, stages = 4, 1
    else:
        bn = cfg.block_n or (max(16, min(128, 16384 // bd)) if bd >= D else 64)
        # measured on H200 (benchmarks/NOTES.md): 4 warps beat 8 for whole-row tiles
        warps = 4 if bd >= D and bn * bd <= 16384 else (8 if bn * bd >= 8192 else 4)
        stages = 1
    if not cuda:  # interpreter: cost is per op, so take big tiles
        bn = cfg.block_n or max(64, bn)
    stages = cfg.num_stages or stages
    if block_c > 1 and bn < 16:
        raise ValueError(f"block_n must be >= 16 when C > 1 (the tile product uses tl.dot), got {bn}")
    # phase R: column chunks of 16 over 256 group rows (16 KB a load): C*D = 1024 gives 65
    # items, so the fixed-order sum is spread over the grid instead of a few programs.
    br = 16 if C * D <= 65536 else 64
    # Not deterministic: float atomics replace the barrier and phase R where the weight fits
    # one tile; the last program then writes the C*D + C + 1 sums out in chunks of BLOCK_R.
    # With no barrier waiting on other programs, the row tiles can be split statically
    # (STRIDED: tiles p, p+P, ... in one pipelined loop, no claims), and the end-of-kernel atomics
    # go to ACC_COPIES accumulators (programs' adds on each address spread 4 ways; the last
    # program out sums the copies in [4, BLOCK_R] loads). LaunchConfig(group_tiles=k) keeps claimed
    # groups of k tiles instead of the static split. H200, BCE D=1024 bf16
    # (tune_dense_head_fixed_s5a.csv, _s5b.csv): N=65536 76.2-77.1 vs 78.3-78.5 us with claimed groups and one
    # accumulator; N=8192 13.9 vs 16.7-16.8 us; N=1024 D=256 5.9 vs 6.5-6.6 us.
    atomic = not deterministic and bd >= D
    if atomic:
        # the last program's sum of the copies in one pass where it fits 2048 columns (C=1 D=512: 514
        # floats, one 1024-wide load instead of two dependent 512-wide ones)
        br = min(2048, next_pow2(C * D + C + 1))
    strided = atomic and not cfg.group_tiles
    two_pass = bool(cfg.two_pass)
    if two_pass and not (strided and block_c == 1):
        raise ValueError("two_pass=True needs a C=1 head in the dense kernel's atomic mode (deterministic=False, "
                         f"whole rows, no group_tiles); got C={C}, D={D}, deterministic={deterministic}, "
                         f"block_d={bd}, group_tiles={cfg.group_tiles}")
    return dict(SINGLE_CHUNK=bd >= D, NUM_STAGES=stages, BLOCK_N=bn, BLOCK_C=block_c, BLOCK_D=bd, maxnreg=maxnreg,
                BLOCK_G=max(1, 4096 // br), BLOCK_R=br, ATOMIC=atomic, STRIDED=strided,
                ACC_COPIES=4 if atomic else 1, TWO_PASS=two_pass,
                num_warps=cfg.num_warps or warps)


_SMALL_MIN_RB = 4  # row blocks per phase-B item of the small CE kernel, at least


def _small_ce_blocks(D: int, C: int, cfg: LaunchConfig, cuda: bool, esize: int) -> dict:
    dp = max(next_pow2(D), 16)
    block_c = max(16, next_pow2(C))
    if cfg.block_n is not None and cfg.block_n < 16:
        raise ValueError(f"block_n must be >= 16 for the small-vocabulary CE kernel (tl.dot tiles), got {cfg.block_n}")
    if cuda:
        # phase A: 64-row tiles, K chunks of 64 (logits) and D chunks of 64 (grad_h), both
        # pipelined 3 deep; phase B: [128, 128] grad_W tiles over 64-row steps. ptxas, sm_90a,
        # C=256 D=512 (benchmarks/compile_report.py): bf16 238 registers, no spills, 136 KB
        # shared; fp32 needs chunks of 32 to fit (234 registers, 168 KB; with 64: 272 KB).
        # 128-row tiles (m64n256 wgmmas, half the W traffic) spill 376 bytes and run 12% faster
        # at 1/8 but 34% slower on the whole device (half as many tiles): not taken.
        chunk = 64 if esize <= 2 else 32
        # C in (256, 512]: 32-row tiles keep the logits at 64 registers a thread
        bn, bk, bdc = cfg.block_n or (64 if block_c <= 256 else 32), min(dp, chunk), min(dp, chunk)
        bcw, bdw, bkw = cfg.block_v or min(block_c, 128), cfg.block_d or min(dp, 128), 64
        warps, stages = cfg.num_warps or 8, cfg.num_stages or 3
    else:  # interpreter: fewer, bigger tiles
        bn, bk, bdc = cfg.block_n or 128, min(dp, 256), min(dp, 256)
        bcw, bdw, bkw = cfg.block_v or block_c, cfg.block_d or min(dp, 256), 128
        warps, stages = cfg.num_warps or 4, cfg.num_stages or 1
    # phase R: few row groups at low occupancy (2 at 1/8 on the H200), so 2 group rows x 2048
    # columns a load: a quarter of the items (latency-bound, a few per program) of 8 x 512
    # GH_T (16-bit inputs, C <= 256): grad_h^T = W^T dz^T, with dz^T written to shared memory once
    # a tile as wgmma's B operand; otherwise dz is the register operand, reloaded from shared
    # memory every D chunk. H200, bf16, C=256 (ce_small_sets_s12a.csv): N=8192 D=512 198 -> 183 µs
    # at 1/8 (phase A 151 -> 134), 41.0 -> 40.1 µs whole device; N=4096 D=256 73.1 -> 69.6 and
    # 30.0 -> 29.2. tf32 has no transposed shared-memory operand for wgmma (GH_T falls back to mma v2).
    return dict(NUM_STAGES=stages, BLOCK_N=bn, BLOCK_C=block_c, BLOCK_K=bk, BLOCK_DC=bdc,
                BLOCK_CW=min(bcw, block_c), BLOCK_DW=bdw, BLOCK_KW=bkw, BLOCK_G=2, BLOCK_R=2048, PHASES=3,
                GH_T=esize <= 2 and block_c <= 256, num_warps=warps)


def _vocab_blocks(D: int, cfg: LaunchConfig, cuda: bool) -> dict:
    dp = max(next_pow2(D), 16)
    if cfg.block_n is not None and cfg.block_n < 16:
        raise ValueError(f"block_n must be >= 16 for the vocabulary kernel (tl.dot tiles), got {cfg.block_n}")
    if cuda:
        bn, bv, bdc, bk = cfg.block_n or 64, cfg.block_v or 128, cfg.block_d or min(dp, 256), min(dp, 64)
    else:  # interpreter: fewer, bigger tiles
        bn, bv, bdc, bk = cfg.block_n or 128, cfg.block_v or 512, cfg.block_d or min(dp, 256), min(dp, 256)
    # phase R (few vocabulary tiles: rows split into G groups, G ~ programs / vocabulary tiles, so
    # small at low occupancy): 8 group rows x 512 columns a load. With 64 x 64 a C=256 D=256 head
    # at occupancy 1/8 (16 programs, G = 8) took 1028 latency-bound items, 64 rounds a program.
    return dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, BLOCK_DC=bdc, BLOCK_G=8, BLOCK_R=512,
                num_warps=cfg.num_warps or 8)


class _Plan:
    """Everything about a launch that does not depend on N, computed once per key."""

    __slots__ = ("kernel", "kind", "constexprs", "opts", "p_occ")

    def __init__(self, kernel, kind, constexprs, num_warps, maxnreg=None):
        self.kernel, self.kind, self.constexprs = kernel, kind, constexprs
        # compile options of every launch: num_warps, and ptxas' register cap where one is set
        self.opts = dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
        self.p_occ = None

    @property
    def num_warps(self) -> int:
        return self.opts["num_warps"]


_PLANS: dict = {}


def _cdiv(a: int, b: int) -> int:
    # not triton.cdiv: that is a @jit function, and calling it from the host costs ~5 µs
    return -(-a // b)


def _plan(loss, reduction, C, D, h_dtype, has_bias, accumulate, cfg, cuda, dot_fp32, precision,
          deterministic: bool = True, relu: bool = False, store_act: bool = False) -> _Plan:
    key = (loss, reduction, C, D, h_dtype, has_bias, accumulate, cfg, cuda, dot_fp32, precision, relu, store_act,
           deterministic)
    p = _PLANS.get(key)
    if p is not None:
        return p
    kind = "dense" if loss != "ce" or C <= DENSE_CE_MAX_C else ("small" if C <= SMALL_CE_MAX_C else "vocab")
    if kind == "dense":
        blk = _dense_blocks(D, C, cfg, cuda, deterministic, h_dtype.itemsize)
    elif kind == "small":
        blk = _small_ce_blocks(D, C, cfg, cuda, h_dtype.itemsize)
    else:
        blk = _vocab_blocks(D, cfg, cuda)
    num_warps = blk.pop("num_warps")
    maxnreg = blk.pop("maxnreg", None)
    # STORE_ACT: the dense and small CE kernels write relu(h) as they read h; the vocabulary
    # kernel reads h once per vocabulary tile and has no such output (the caller applies the ReLU)
    cx = dict(HAS_BIAS=has_bias, ACCUMULATE=accumulate, DOT_FP32=dot_fp32, PRECISION=precision, N_CTR=_N_CTR,
              RELU=relu, STORE_ACT=store_act and kind != "vocab", **blk)
    if kind == "dense":
        cx.update(LOSS=LOSSES[loss], CE_MEAN=(loss == "ce" and reduction == "mean"))
        kernel = _dense_head_kernel
    else:
        cx.update(CE_MEAN=reduction == "mean")
        kernel = _small_ce_kernel if kind == "small" else _vocab_ce_kernel
    names = [n for n, q in inspect.signature(kernel.fn).parameters.items() if "constexpr" in str(q.annotation)]
    cx = {k: cx[k] for k in names}  # declaration order: the direct launcher passes them positionally
    p = _PLANS[key] = _Plan(kernel, kind, cx, num_warps, (cfg.max_registers or maxnreg) if cuda else None)
    return p


def _program_count(plan: _Plan, make_args, device, cfg: LaunchConfig) -> int:
    # make_args() builds warm-up arguments; only called when the plan is new
    if plan.p_occ is None or device.type != "cuda":
        plan.p_occ = num_programs(plan.kernel, id(plan), lambda: plan.kernel.warmup(
            *make_args(), grid=(1,), **plan.opts, **plan.constexprs), device, plan.num_warps, cfg.occupancy,
            cfg.programs_per_sm)
    return plan.p_occ


class HeadLaunch:
    """One head call with everything but the tensors fixed (plan, grid, ints, compiled kernel).

    Built once per call signature (shapes, strides, dtypes, alignment, options) by
    `prepare_launch`; calling it allocates grad_h and the loss and launches. On CUDA it
    calls Triton's compiled launcher directly with raw pointers: the generic dispatch
    (argument binding, specialisation hashing, a driver query per pointer) costs more
    host time than a small head's whole kernel. Triton's launch hooks
    (`knobs.runtime.launch_enter_hook`, used by proton) are therefore not called for it.
    """

    __slots__ = ("plan", "device", "index", "n_buf", "n_acc", "P", "ints", "cx", "loss_like",
                 "has_bias", "store_act", "raw", "function", "packed", "coop", "pdl", "compiled", "__weakref__")

    def __call__(self, h, weight, bias, y, grad_weight, grad_bias, act=None):
        """h: the rows with the strides this launch was prepared for (any leading shape).
        act: None, or a contiguous tensor with h's elements that receives relu(h): from the kernel
        as it reads h when `store_act` (prepared with store_act=True, a kernel with that output),
        else from torch.clamp_min after the launch.
        Returns (loss, grad_h contiguous, shaped like h)."""
        dev = self.device
        if self.raw is not None:
            stream = torch._C._cuda_getCurrentRawStream(self.index)
            ws = _WORKSPACES.get((self.index, stream)) or _workspace(dev)
        else:
            ws = _workspace(dev)
        # empty_like: half the host cost of torch.empty(shape, dtype=, device=)
        grad_h = torch.empty_like(h, memory_format=torch.contiguous_format)
        loss_out = torch.empty_like(self.loss_like)
        buf = ws.buf if ws.buf.numel() >= self.n_buf else ws.floats(self.n_buf)
        acc = ws.acc if ws.acc.numel() >= self.n_acc else ws.zeros(self.n_acc)
        if POISON:
            grad_h.fill_(float("nan"))
            loss_out.fill_(float("nan"))
            buf.fill_(float("nan"))
        if not self.has_bias:
            bias, grad_bias = weight, grad_weight  # unused pointers (HAS_BIAS=False)
        act_out = act if self.store_act else grad_h  # (STORE_ACT=False: an unused pointer)
        if self.raw is None:
            try:
                self.plan.kernel[(self.P,)](h, weight, bias, y, grad_h, act_out, grad_weight, grad_bias, loss_out, buf, acc,
                                            ws.ctr, *self.ints, **self.plan.opts, **self.plan.constexprs)
            except BaseException:
                # A kernel stopped part-way (the interpreter runs its programs on the host, and an error
                # or Ctrl-C can stop one) leaves counters and accumulators that every launch expects at
                # zero: the next launch on this workspace would wait on them forever.
                ws.ctr.zero_()
                ws.acc.zero_()
                raise
        else:
            self.raw(self.P, 1, 1, stream, self.function, self.coop, self.pdl, None, None, self.packed, None, None,
                     None, h.data_ptr(), weight.data_ptr(), bias.data_ptr(), y.data_ptr(), grad_h.data_ptr(),
                     act_out.data_ptr(), grad_weight.data_ptr(), grad_bias.data_ptr(), loss_out.data_ptr(), buf.data_ptr(),
                     acc.data_ptr(), ws.ctr.data_ptr(), *self.ints, *self.cx)
        if act is not None and not self.store_act:  # (the vocabulary kernel has no relu(h) output)
            torch.clamp_min(h.detach(), 0, out=act.view(h.shape))
        return loss_out, grad_h


def _direct_launcher(hl: HeadLaunch, compiled) -> None:
    # Triton's CudaLauncher.__call__ allocates scratch (none here) and forwards to the C
    # `launch`; call that directly when nothing else is needed, else fall back to __call__.
    launcher = compiled.run  # loads the binary on first use
    hl.function, hl.packed = compiled.function, compiled.packed_metadata
    plain = (getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0
             and hasattr(launcher, "launch"))
    if plain:
        hl.raw, hl.coop, hl.pdl = launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl
    else:
        def raw(gx, gy, gz, stream, function, _coop, _pdl, _gs, _ps, packed, *rest):
            launcher(gx, gy, gz, stream, function, packed, *rest)
        hl.raw, hl.coop, hl.pdl = raw, None, None


def prepare_launch(h2, weight, bias, y, loss: str, reduction: str, ignore_index: int, cfg: LaunchConfig,
                   grad_weight: torch.Tensor, grad_bias, accumulate: bool, relu: bool = False,
                   store_act: bool = False) -> HeadLaunch:
    """Plan one launch for h2 [N, D] (unit stride on D) and y ([N, C] float or [N] int).
    relu: the head reads relu(h2) and grad_h is the gradient at the ReLU's input.
    store_act: the kernel also writes relu(h2) where it can (`HeadLaunch.store_act` says)."""
    N, D = h2.shape
    C = weight.shape[0]
    dev = h2.device
    cuda = dev.type == "cuda"
    if cuda and _device_index(dev) != torch.cuda.current_device():
        raise ValueError(f"h is on {dev} but the current CUDA device is cuda:{torch.cuda.current_device()}; "
                         f"call torch.cuda.set_device({dev}) or use `with torch.cuda.device(...)`")
    ws = _workspace(dev)
    has_bias = bias is not None
    dot_fp32 = interpreting()
    precision = "ieee"
    if not dot_fp32 and h2.dtype == torch.float32:
        precision = cfg.fp32_precision or ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
    deterministic = cfg.deterministic if cfg.deterministic is not None else torch.are_deterministic_algorithms_enabled()
    plan = _plan(loss, reduction, C, D, h2.dtype, has_bias, accumulate, cfg, cuda, dot_fp32, precision, deterministic,
                 relu, store_act and relu)
    cx = plan.constexprs
    if plan.kind == "dense" and cx["STRIDED"] and not cx["ATOMIC"]:
        # a static tile split needs no claims only where no grid barrier waits on other programs
        raise ValueError("STRIDED row tiles need the ATOMIC (non-deterministic, one weight tile) dense kernel")
    b_arg = bias if has_bias else weight
    gb_arg = grad_bias if has_bias else grad_weight
    bn = cx["BLOCK_N"]
    n_tiles = _cdiv(N, bn)
    stride_g = _cdiv(C * D + C + 1, 16) * 16

    def args(P, G, tpg, inv_count):
        # warm-up arguments: dtypes stand for library-allocated (aligned) outputs and scratch
        return (h2, weight, b_arg, y, h2.dtype, h2.dtype, grad_weight, gb_arg, torch.float32, torch.float32, torch.float32, ws.ctr,
                N, D, C, h2.stride(0), stride_g, ignore_index, inv_count, n_tiles, G, tpg, P)

    p_occ = _program_count(plan, lambda: args(1, 1, 1, 1.0), dev, cfg)
    if plan.kind == "dense":
        inv_count = 1.0 / (N * C) if reduction == "mean" else 1.0
        if cx["STRIDED"]:  # one "group" a program: tiles pid, pid + P, ...
            tpg = 1
        elif cfg.group_tiles:
            tpg = cfg.group_tiles
        else:  # the tiles spread evenly, one group a program
            tpg = _cdiv(n_tiles, min(p_occ, n_tiles))
        G = _cdiv(n_tiles, tpg)
        if cx["ATOMIC"]:
            P = min(p_occ, G)
            if cx["STRIDED"]:
                G = P
            n_buf, n_acc = (N if cx["TWO_PASS"] else 0), cx["ACC_COPIES"] * stride_g  # (TWO_PASS: dz)
        else:
            n_r = _cdiv(C * D + C + 1, cx["BLOCK_R"])
            P = min(p_occ, max(G, n_r))  # no program without work
            n_buf, n_acc = G * stride_g, 0
    elif plan.kind == "small":
        inv_count = 1.0
        n_out = _cdiv(C, cx["BLOCK_CW"]) * _cdiv(D, cx["BLOCK_DW"])
        n_rb = _cdiv(N, cx["BLOCK_KW"])
        # split-K: enough row groups that phase B fills the grid, each at least MIN_RB row blocks
        # long (something for the load pipeline to overlap)
        G = max(1, min(_cdiv(p_occ, n_out), n_rb // _SMALL_MIN_RB))
        tpg = _cdiv(n_rb, G)
        G = _cdiv(n_rb, tpg)
        P = min(p_occ, max(n_tiles, n_out * G))
        dz_floats = _cdiv(N * cx["BLOCK_C"] * h2.element_size(), 4)
        n_buf = _cdiv(n_tiles, 16) * 16 + (G * stride_g if G > 1 else 0) + dz_floats
        n_acc = 0
    else:
        inv_count = 1.0
        n_v = _cdiv(C, cx["BLOCK_V"])
        n_dc = _cdiv(D, cx["BLOCK_DC"])
        # Few vocabulary tiles: split rows into groups so phase B keeps every program busy.
        G = 1 if n_v * n_dc >= p_occ else min(_cdiv(p_occ, n_v * n_dc), n_tiles)
        tpg = _cdiv(n_tiles, G)
        G = _cdiv(n_tiles, tpg)
        P = min(p_occ, max(n_tiles * n_dc, n_v * G * n_dc))
        n_buf = N + n_tiles + (G * stride_g if G > 1 else 0)
        n_acc = 0
    hl = HeadLaunch()
    hl.plan, hl.device = plan, dev
    hl.loss_like = torch.empty((), dtype=torch.float32, device=dev)
    hl.n_buf, hl.n_acc, hl.P, hl.has_bias, hl.cx = n_buf, n_acc, P, has_bias, tuple(cx.values())
    hl.store_act = bool(cx.get("STORE_ACT", False))
    hl.ints = (N, D, C, h2.stride(0), stride_g, ignore_index, inv_count, n_tiles, G, tpg, P)
    hl.raw = hl.compiled = None
    if cuda:
        hl.index = _device_index(dev)
        hl.compiled = plan.kernel.warmup(*args(P, G, tpg, inv_count), grid=(P,), **plan.opts, **cx)
        _direct_launcher(hl, hl.compiled)
    return hl

