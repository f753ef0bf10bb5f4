"""The dense head kernel: C <= 64 ("bce", "mse", and "ce" with few classes), one launch.

A row tile's logits fit in registers, so dz is known after one pass over D; grad_h is
written at once and grad_W is summed per *row group* into a private fp32 slot, then summed
in a fixed order after a grid barrier (deterministic), or added with float atomics into
ACC_COPIES zeroed accumulators where the weight fits one tile (`LaunchConfig.deterministic`).
Reference: `erase_triton.reference.local_head`; tests: tests/test_dense_head.py, tests/test_local_head.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (claim, item_done, wait_all, last_out, reset_counters, exit_grid, count_targets, ce_rows, tile_dot,
                     reduce_rows, relu_in, relu_out, store_scalar)


@triton.jit
def bce_or_mse(b_z, b_y, scale, LOSS: tl.constexpr):
    # elementwise loss and dz = scale * dLoss/dz: sigmoid BCE in its stable form (LOSS 0), squared error (2)
    if LOSS == 0:
        b_l = tl.maximum(b_z, 0.0) - b_z * b_y + tl.log(1.0 + tl.exp(-tl.abs(b_z)))
        b_dz = (1.0 / (1.0 + tl.exp(-b_z)) - b_y) * scale
    else:
        b_l = (b_z - b_y) * (b_z - b_y)
        b_dz = 2.0 * (b_z - b_y) * scale
    return b_l, b_dz


@triton.jit(do_not_specialize=["N", "ignore_index", "n_tiles", "n_groups", "tiles_per_group", "n_programs"])
def dense_head_kernel(
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
    # RELU: the head reads relu(h) (every h load goes through relu_in) and grad_h is the
    # gradient at the ReLU's input (masked where h <= 0), so the block's own ReLU backward
    # is not needed. STORE_ACT: relu(h) is also written out (for a head nothing runs beside:
    # no separate ReLU launch before it).
    if CE_MEAN:
        scale = count_targets(y_ptr, ctr_ptr, N, ignore_index, 1024)
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
        g = claim(ctr_ptr + 2)
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
            b_h1 = relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d1[None, :], mask=m_h1, other=0.0), RELU)
            b_z = tl.sum(b_h1.to(tl.float32) * b_w[None, :], axis=1)
            if HAS_BIAS:
                b_z += tl.load(b_ptr).to(tl.float32)
            b_y = tl.load(y_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
            b_l, b_dz = bce_or_mse(b_z, b_y, scale, LOSS)
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
            b_h1 = relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d1[None, :], mask=m_h1, other=0.0), RELU)
            if STORE_ACT:
                tl.store(act_ptr + o_n[:, None] * D + o_d1[None, :], b_h1, mask=m_h1)
            b_gh = b_dz[:, None] * b_w[None, :]
            b_acc += tl.sum(b_dz[:, None] * b_h1.to(tl.float32), axis=0)
            tl.store(gh_ptr + o_n[:, None] * D + o_d1[None, :], relu_out(b_gh, b_h1, RELU).to(gh_ptr.dtype.element_ty),
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
                    b_h1 = relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d1[None, :], mask=m_h1, other=0.0), RELU)
                    if STORE_ACT:
                        tl.store(act_ptr + o_n[:, None] * D + o_d1[None, :], b_h1, mask=m_h1)
                    if BLOCK_C == 1:
                        b_z = tl.sum(b_h1.to(tl.float32) * b_w1.to(tl.float32), axis=1)[:, None]
                    else:
                        b_z = tile_dot(b_h1, tl.trans(b_w1).to(b_h1.dtype), DOT_FP32, PRECISION)
                else:
                    b_z = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
                    for d0 in range(0, D, BLOCK_D):
                        o_d = d0 + tl.arange(0, BLOCK_D)
                        m_d = o_d < D
                        b_h = relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d[None, :], mask=m_n[:, None] & m_d[None, :],
                                               other=0.0), RELU)
                        if STORE_ACT:
                            tl.store(act_ptr + o_n[:, None] * D + o_d[None, :], b_h, mask=m_n[:, None] & m_d[None, :])
                        b_w = tl.load(w_ptr + o_c[:, None] * D + o_d[None, :], mask=m_c[:, None] & m_d[None, :], other=0.0)
                        if BLOCK_C == 1:
                            b_z += tl.sum(b_h.to(tl.float32) * b_w.to(tl.float32), axis=1)[:, None]
                        else:
                            b_z += tile_dot(b_h, tl.trans(b_w).to(b_h.dtype), DOT_FP32, PRECISION)
                if HAS_BIAS:
                    b_z += tl.load(b_ptr + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
                m_nc = m_n[:, None] & m_c[None, :]
                # loss and dz = dLoss/dz, [BLOCK_N, BLOCK_C]
                if LOSS == 1:  # softmax cross-entropy over C classes
                    b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
                    m_row, b_bad = ce_rows(b_t, m_n, ignore_index, C)
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
                    b_l, b_dz = bce_or_mse(b_z, b_y, scale, LOSS)
                    b_loss += tl.sum(tl.where(m_nc, b_l, 0.0), axis=1)
                    b_dz = tl.where(m_nc, b_dz, 0.0)
                b_gb += tl.sum(b_dz, axis=0)
                # pass 2: grad_h = dz W, group partial of grad_W += dz^T h
                if SINGLE_CHUNK:
                    if BLOCK_C == 1:
                        b_gh = b_dz * b_w1.to(tl.float32)
                        b_gw1 += tl.sum(b_dz * b_h1.to(tl.float32), axis=0)[None, :]
                    else:
                        b_gh = tile_dot(b_dz.to(b_h1.dtype), b_w1.to(b_h1.dtype), DOT_FP32, PRECISION)
                        b_gw1 += tile_dot(tl.trans(b_dz).to(b_h1.dtype), b_h1, DOT_FP32, PRECISION)
                    tl.store(gh_ptr + o_n[:, None] * D + o_d1[None, :], relu_out(b_gh, b_h1, RELU).to(gh_ptr.dtype.element_ty),
                             mask=m_h1)
                else:
                    first = t == t_lo
                    for d0 in range(0, D, BLOCK_D):
                        o_d = d0 + tl.arange(0, BLOCK_D)
                        m_d = o_d < D
                        m_cd = m_c[:, None] & m_d[None, :]
                        b_h = relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_d[None, :], mask=m_n[:, None] & m_d[None, :],
                                               other=0.0), RELU)
                        b_w = tl.load(w_ptr + o_c[:, None] * D + o_d[None, :], mask=m_cd, other=0.0)
                        if BLOCK_C == 1:
                            b_gh = b_dz * b_w.to(tl.float32)
                            b_gw = tl.sum(b_dz * b_h.to(tl.float32), axis=0)[None, :]
                        else:
                            b_gh = tile_dot(b_dz.to(b_h.dtype), b_w.to(b_h.dtype), DOT_FP32, PRECISION)
                            b_gw = tile_dot(tl.trans(b_dz).to(b_h.dtype), b_h, DOT_FP32, PRECISION)
                        tl.store(gh_ptr + o_n[:, None] * D + o_d[None, :], relu_out(b_gh, b_h, RELU).to(gh_ptr.dtype.element_ty),
                                 mask=m_n[:, None] & m_d[None, :])
                        p_part = p_row + o_c[:, None] * D + o_d[None, :]
                        if not first:
                            b_gw += tl.load(p_part, mask=m_cd, other=0.0)
                        tl.store(p_part, b_gw, mask=m_cd)
            if not ATOMIC:
                if SINGLE_CHUNK:
                    tl.store(p_row + o_c[:, None] * D + o_d1[None, :], b_gw1, mask=m_cd1)
                tl.store(p_row + CD + o_c, b_gb, mask=m_c)
                store_scalar(p_row + CD + C, tl.sum(b_loss, axis=0))
                item_done(ctr_ptr + 3)
            if STRIDED:
                g = n_groups
            else:
                g = claim(ctr_ptr + 2)

    if ATOMIC:  # (SINGLE_CHUNK only) float atomics: the sum's order follows program timing
        # ACC_COPIES accumulators (stride_g apart) split the programs' atomics on each address
        p_acc = acc_ptr + (tl.program_id(0) % ACC_COPIES) * stride_g
        tl.atomic_add(p_acc + o_c[:, None] * D + o_d1[None, :], b_gw1, mask=m_cd1, sem="relaxed")
        tl.atomic_add(p_acc + CD + o_c, b_gb, mask=m_c, sem="relaxed")
        tl.atomic_add(p_acc + CD + C, tl.sum(b_loss, axis=0), sem="relaxed")
        # The last program out sums the copies, writes the outputs, and re-zeroes acc and counters.
        if last_out(ctr_ptr, n_programs):
            tl.debug_barrier()
            for r in range(0, tl.cdiv(CD + C + 1, BLOCK_R)):
                reduce_rows(acc_ptr, stride_g, ACC_COPIES, CD, C, gw_ptr, gb_ptr, loss_ptr, scale, r,
                             HAS_BIAS, ACCUMULATE, True, ACC_COPIES, BLOCK_R)
                o_f = r * BLOCK_R + tl.arange(0, BLOCK_R)
                for k in tl.static_range(ACC_COPIES):
                    tl.store(acc_ptr + k * stride_g + o_f, tl.zeros([BLOCK_R], dtype=tl.float32),
                             mask=o_f < CD + C + 1)
            reset_counters(ctr_ptr, N_CTR)
    else:
        wait_all(ctr_ptr + 3, n_groups)
        # ---- phase R: fixed-order sums of the group rows -> grad_W, grad_b, loss
        n_r = tl.cdiv(CD + C + 1, BLOCK_R)
        r = claim(ctr_ptr + 6)
        while r < n_r:
            reduce_rows(part_ptr, stride_g, n_groups, CD, C, gw_ptr, gb_ptr, loss_ptr, scale, r,
                         HAS_BIAS, ACCUMULATE, True, BLOCK_G, BLOCK_R)
            r = claim(ctr_ptr + 6)
        exit_grid(ctr_ptr, n_programs, N_CTR)
