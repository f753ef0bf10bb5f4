"""Device helpers shared by the head kernels: work claims and grid barriers, fixed-order sums,
the dot with its precision switch, and the ReLU taken over from the block.

The grid is persistent and sized by `occupancy`. Programs *claim* work items from an
atomic counter; a phase ends at a grid barrier (count of finished items). Every claimed
item belongs to a program that is already running, so the barrier cannot deadlock even
when only part of the grid is resident (beside a GEMM on another stream). Counters live in
a small per-stream int32 workspace (`plan.Workspace`); the last program to exit resets them,
so consecutive launches on one stream need no memset. Derivation: docs/local_head.md.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Counter slots in the int32 workspace (the kernels index ctr_ptr + slot):
#   0/1 claim/done of phase 0 (count targets), 2/3 phase A, 4/5 phase B, 6 claim of phase R,
#   7 non-ignored target count, 8 programs exited.
N_CTR = 16

# A gpu-scope fence in every thread before an item's release and after a wait (the CUDA guide's
# __threadfence() before __syncthreads()): with only the one thread's release after the barrier, a
# program on the H200 read stale rows of scratch that another program had rewritten
# (docs/local_head.md#memory-ordering). The interpreter runs programs one at a time and has no PTX.
_THREAD_FENCE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def fence_all_threads():
    if _THREAD_FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [tl.arange(0, 256)], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def claim(ctr_ptr):
    # Next work item of a phase; relaxed is enough, ordering comes from the barrier.
    return tl.atomic_add(ctr_ptr, 1, sem="relaxed")


@triton.jit
def item_done(done_ptr):
    # Every thread's stores of this item are visible device-wide before the release increment.
    fence_all_threads()
    tl.debug_barrier()
    tl.atomic_add(done_ptr, 1, sem="release")


@triton.jit
def wait_all(done_ptr, n_items):
    # Grid barrier over *claimed items*, safe with a partially resident grid. Every thread spins on
    # volatile loads (reads: cheap for the L2 even with thousands of waiters); its fence after the
    # load that saw the count is its acquire (PTX's fence-based pattern). No atomic acquire: Triton 3.6
    # lowers atomic_add(p, 0, sem="acquire") to one thread's load and drops it when the result is unused
    # (tests/test_local_head.py::test_grid_barrier_acquires_in_every_thread).
    done = tl.load(done_ptr, volatile=True)
    while done < n_items:
        done = tl.load(done_ptr, volatile=True)
    fence_all_threads()
    tl.debug_barrier()


@triton.jit
def last_out(ctr_ptr, n_programs):
    # True in the last program to get here (after every other program's writes: acq_rel).
    tl.debug_barrier()
    return tl.atomic_add(ctr_ptr + 8, 1, sem="acq_rel") == n_programs - 1


@triton.jit
def reset_counters(ctr_ptr, N_CTR: tl.constexpr):
    tl.store(ctr_ptr + tl.arange(0, N_CTR), tl.zeros([N_CTR], dtype=tl.int32))


@triton.jit
def exit_grid(ctr_ptr, n_programs, N_CTR: tl.constexpr):
    # The last program out resets every counter for the next launch on this stream.
    if last_out(ctr_ptr, n_programs):
        reset_counters(ctr_ptr, N_CTR)


@triton.jit
def count_targets(y_ptr, ctr_ptr, N, ignore_index, BLOCK: tl.constexpr):
    # Phase 0 of a mean CE: number of rows whose target is not ignore_index.
    n_items = tl.cdiv(N, BLOCK)
    item = claim(ctr_ptr + 0)
    while item < n_items:
        o_n = tl.arange(0, BLOCK).to(tl.int64) + item * BLOCK
        b_y = tl.load(y_ptr + o_n, mask=o_n < N, other=ignore_index)
        tl.atomic_add(ctr_ptr + 7, tl.sum((b_y != ignore_index).to(tl.int32), 0), sem="relaxed")
        item_done(ctr_ptr + 1)
        item = claim(ctr_ptr + 0)
    wait_all(ctr_ptr + 1, n_items)
    count = tl.atomic_add(ctr_ptr + 7, 0, sem="acquire")
    return 1.0 / count.to(tl.float32)


@triton.jit
def ce_rows(b_t, m_n, ignore_index, C):
    # The rows of a CE tile that count (loaded, target not ignore_index), and a poison vector:
    # NaN where such a row's class id lies outside [0, C), else 0. Added to the row's loss and
    # to its gradient scale, it makes the loss and every gradient it reaches NaN, where
    # PyTorch would stop with an index error; checking the ids on the host would need a sync.
    m_row = m_n & (b_t != ignore_index)
    return m_row, tl.where(m_row & ((b_t < 0) | (b_t >= C)), float("nan"), 0.0)


@triton.jit
def tile_dot(a, b, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    # The interpreter computes bf16/fp16 dots wrongly: upcast there (DOT_FP32). The operands must
    # share a dtype (tl.dot's rule on the GPU; asserted here so the interpreter's upcast hides no mix).
    tl.static_assert(a.dtype == b.dtype, "tile_dot: operands of different dtypes (cast the weight tile to h's)")
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def store_grad(p_out, val, mask, ACCUMULATE: tl.constexpr):
    # val is fp32; ACCUMULATE adds onto what the parameter's .grad already holds.
    if ACCUMULATE:
        val += tl.load(p_out, mask=mask, other=0.0).to(tl.float32)
    tl.store(p_out, val.to(p_out.dtype.element_ty), mask=mask)


@triton.jit
def grad_scale(scale):
    # the factor of a CE kernel's fp32 gradient sums: the loss's scale, or 0 where every row is ignored
    # (scale = 1 / 0): zero gradients, as PyTorch's, and a NaN loss
    return tl.where(scale < float("inf"), scale, 0.0)


@triton.jit
def store_scalar(ptr, x):
    # one fp32 value to ptr[0], stored as a 1-element vector
    tl.store(ptr + tl.arange(0, 1), x + tl.zeros([1], dtype=tl.float32))


@triton.jit
def sum_vec(ptr, n, BLOCK: tl.constexpr):
    # Fixed-order sum of n fp32 values written by other programs (vector loads, not a scalar chain).
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i0 in range(0, n, BLOCK):
        o = i0 + tl.arange(0, BLOCK)
        b_acc += tl.load(ptr + o, mask=o < n, other=0.0, cache_modifier=".cg")
    return tl.sum(b_acc, axis=0)


@triton.jit
def sum_rows(ptr, n_rows, stride, o_c, m_c, BLOCK_P: tl.constexpr):
    # Fixed-order sum over n_rows fp32 partial rows (written by other programs) of columns o_c: BLOCK_P rows a load.
    b_acc = tl.zeros(o_c.shape, dtype=tl.float32)
    for t0 in range(0, n_rows, BLOCK_P):
        o_t = t0 + tl.arange(0, BLOCK_P)
        b_acc += tl.sum(tl.load(ptr + o_t[:, None] * stride + o_c[None, :],
                                mask=(o_t < n_rows)[:, None] & m_c[None, :], other=0.0, cache_modifier=".cg"), axis=0)
    return b_acc


@triton.jit
def reduce_rows(part_ptr, stride_g, G, CD, C, gw_ptr, gb_ptr, loss_ptr, scale, r,
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
    store_grad(gw_ptr + o_e, b_acc, o_e < CD, ACCUMULATE)
    if HAS_BIAS:
        store_grad(gb_ptr + (o_e - CD), b_acc, (o_e >= CD) & (o_e < CD + C), ACCUMULATE)
    if WITH_LOSS:
        tl.store(loss_ptr + (o_e - CD - C), b_acc * scale, mask=o_e == CD + C)


@triton.jit
def sum_group_rows(part_ptr, stride_g, n_groups, n_b, C, D, gw_ptr, gb_ptr, loss_ptr, scale, ctr_ptr,
                    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr):
    # Phase R of the CE kernels: after phase B's n_b items (counters 4/5), the [grad_W | grad_b]
    # group rows are summed in group order, BLOCK_R columns an item (counter 6).
    wait_all(ctr_ptr + 5, n_b)
    n_r = tl.cdiv(C * D + C, BLOCK_R)
    r = claim(ctr_ptr + 6)
    while r < n_r:
        reduce_rows(part_ptr, stride_g, n_groups, C * D, C, gw_ptr, gb_ptr, loss_ptr, scale, r,
                     HAS_BIAS, ACCUMULATE, False, BLOCK_G, BLOCK_R)
        r = claim(ctr_ptr + 6)


@triton.jit
def relu_in(b_h, RELU: tl.constexpr):
    # the head's input is relu(h) when RELU (a no-op on an input that is already a ReLU's output)
    if RELU:
        return tl.maximum(b_h, 0.0).to(b_h.dtype)
    return b_h


@triton.jit
def relu_out(b_g, b_h, RELU: tl.constexpr):
    # gradient at the ReLU's input: zero where relu(h) == 0 (h <= 0, torch's threshold_backward)
    if RELU:
        return tl.where(b_h > 0, b_g, 0.0)
    return b_g


@triton.jit
def logits_tile(h_ptr, w_ptr, b_ptr, o_n, m_n, o_v, m_v, D, stride_h, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, RELU: tl.constexpr):
    # z = h[o_n] W[o_v]^T + b[o_v], fp32 [BLOCK_N, BLOCK_V], accumulated over K chunks of D
    b_z = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < D
        b_h = relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                               other=0.0), RELU)
        b_w = tl.load(w_ptr + o_v.to(tl.int64)[:, None] * D + o_k[None, :], mask=m_v[:, None] & m_k[None, :], other=0.0)
        b_z += tile_dot(b_h, tl.trans(b_w).to(b_h.dtype), DOT_FP32, PRECISION)
    if HAS_BIAS:
        b_z += tl.load(b_ptr + o_v, mask=m_v, other=0.0).to(tl.float32)[None, :]
    return b_z


@triton.jit
def pad16(x):
    # workspace regions start at 64-byte boundaries (vector loads)
    return tl.cdiv(x, 16) * 16


@triton.jit
def wait_stage(done_ptr, passed, start):
    # Stages of one work queue (the chunked vocabulary kernels): before an item of the stage whose
    # first item is `start`, every earlier item is done. `passed`: the start this program last waited
    # for (none again). Items are claimed in order, so every earlier item belongs to a running program.
    if passed < start:
        wait_all(done_ptr, start)
    return tl.maximum(passed, start)


@triton.jit
def combine_lse(m_ptr, s_ptr, stride, n_parts, o_r, m_r, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    # Log-sum-exp of rows o_r from n_parts partial (max, sum of exp(z - max)) pairs, part p of row i
    # at p * stride + i: BLOCK_P parts a 2D load (one round trip, not one a part), combined online in
    # a fixed order. Masked rows get 0.
    b_m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    b_s = tl.zeros([BLOCK_R], dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        msk = (o_p < n_parts)[:, None] & m_r[None, :]
        off = o_p.to(tl.int64)[:, None] * stride + o_r[None, :]
        b_pm = tl.load(m_ptr + off, mask=msk, other=float("-inf"), cache_modifier=".cg")
        b_ps = tl.load(s_ptr + off, mask=msk, other=0.0, cache_modifier=".cg")
        b_new = tl.maximum(b_m, tl.max(b_pm, axis=0))
        b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)  # (a row with nothing yet: no inf - inf)
        b_s = b_s * tl.exp(b_m - b_ref) + tl.sum(b_ps * tl.exp(b_pm - b_ref[None, :]), axis=0)
        b_m = b_new
    return tl.where(m_r & (b_s > 0), b_m + tl.log(tl.where(b_s > 0, b_s, 1.0)), 0.0)


@triton.jit
def lse_and_loss(m_ptr, s_ptr, stride, n_parts, lse_ptr, zt_ptr, part_ptr, y_ptr, o_n, o_s, m_n, ignore_index, C,
                 BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    # A row tile of the chunked vocabulary kernels: each row's lse from its partial (max, sum) pairs
    # (stored), and the tile's loss partial sum(lse - z_t) (NaN for a bad id) to part_ptr[0].
    # o_n: the rows (for their targets); o_s: the same rows' index in the scratch.
    b_lse = combine_lse(m_ptr, s_ptr, stride, n_parts, o_s, m_n, BLOCK_R, BLOCK_P)
    tl.store(lse_ptr + o_s, b_lse, mask=m_n)
    b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
    m_row, b_bad = ce_rows(b_t, m_n, ignore_index, C)
    b_zt = tl.load(zt_ptr + o_s, mask=m_row, other=0.0, cache_modifier=".cg")
    store_scalar(part_ptr, tl.sum(tl.where(m_row, b_lse - b_zt, 0.0) + b_bad, axis=0))
