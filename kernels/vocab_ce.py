"""The vocabulary CE kernel: "ce" with C > 512 (vocabularies up to 128K), one launch.

Phase A runs over row tiles with an online log-sum-exp and accumulates grad_h = softmax @ W
flash-attention style; phase B runs over vocabulary tiles and sums grad_W from recomputed
logits and the lse saved by phase A. The logits never reach memory.
Reference: `erase_triton.reference.local_head`; tests: tests/test_vocab_ce.py, tests/test_local_head.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (claim, item_done, wait_all, exit_grid, count_targets, ce_rows, tile_dot, store_grad, sum_vec,
                     sum_group_rows, relu_in, relu_out, logits_tile, store_scalar, grad_scale)


@triton.jit(do_not_specialize=["N", "ignore_index", "n_tiles", "n_groups", "tiles_per_group", "n_programs"])
def vocab_ce_kernel(
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
        scale = count_targets(y_ptr, ctr_ptr, N, ignore_index, 1024)
    else:
        scale = inv_count
    gscale = grad_scale(scale)
    lse_ptr = ws_ptr
    part_l_ptr = ws_ptr + N
    part_ptr = ws_ptr + N + n_tiles
    n_dc = tl.cdiv(D, BLOCK_DC)
    n_v = tl.cdiv(C, BLOCK_V)

    # ---- phase A: (row tile, D chunk) -> lse, loss, grad_h = scale*(softmax(z) W - W[t])
    n_a = n_tiles * n_dc
    item = claim(ctr_ptr + 2)
    while item < n_a:
        t = item // n_dc
        dc = item % n_dc
        o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
        m_n = o_n < N
        o_dc = dc * BLOCK_DC + tl.arange(0, BLOCK_DC)
        m_dc = o_dc < D
        b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
        m_row, b_bad = ce_rows(b_t, m_n, ignore_index, C)
        b_m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        b_s = tl.zeros([BLOCK_N], dtype=tl.float32)
        b_zt = tl.zeros([BLOCK_N], dtype=tl.float32)
        b_acc = tl.zeros([BLOCK_N, BLOCK_DC], dtype=tl.float32)
        for v0 in range(0, C, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            m_v = o_v < C
            b_z = logits_tile(h_ptr, w_ptr, b_ptr, o_n, m_n, o_v, m_v, D, stride_h,
                               HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32, PRECISION, RELU)
            b_z = tl.where(m_v[None, :], b_z, float("-inf"))
            b_zt += tl.sum(tl.where(o_v[None, :] == b_t[:, None], b_z, 0.0), axis=1)
            b_mnew = tl.maximum(b_m, tl.max(b_z, axis=1))
            b_alpha = tl.exp(b_m - b_mnew)
            b_p = tl.exp(b_z - b_mnew[:, None])
            b_s = b_s * b_alpha + tl.sum(b_p, axis=1)
            b_wd = tl.load(w_ptr + o_v.to(tl.int64)[:, None] * D + o_dc[None, :], mask=m_v[:, None] & m_dc[None, :], other=0.0)
            b_acc = b_acc * b_alpha[:, None] + tile_dot(b_p.to(b_wd.dtype), b_wd, DOT_FP32, PRECISION)
            b_m = b_mnew
        b_lse = b_m + tl.log(b_s)
        m_id = m_row & (b_t >= 0) & (b_t < C)  # the gather W[t] reads only in-range rows
        b_wt = tl.load(w_ptr + b_t.to(tl.int64)[:, None] * D + o_dc[None, :], mask=m_id[:, None] & m_dc[None, :], other=0.0)
        b_gh = (tl.where(m_row, scale, 0.0) + b_bad)[:, None] * (b_acc / b_s[:, None] - b_wt.to(tl.float32))
        if RELU:
            b_gh = relu_out(b_gh, tl.load(h_ptr + o_n[:, None] * stride_h + o_dc[None, :],
                                           mask=m_n[:, None] & m_dc[None, :], other=0.0), RELU)
        tl.store(gh_ptr + o_n[:, None] * D + o_dc[None, :], b_gh.to(gh_ptr.dtype.element_ty), mask=m_n[:, None] & m_dc[None, :])
        if dc == 0:
            tl.store(lse_ptr + o_n, b_lse, mask=m_n)
            store_scalar(part_l_ptr + t, tl.sum(tl.where(m_row, b_lse - b_zt, 0.0) + b_bad, axis=0))
        item_done(ctr_ptr + 3)
        item = claim(ctr_ptr + 2)
    wait_all(ctr_ptr + 3, n_a)

    # ---- phase B: (vocab tile, row group, D chunk) -> grad_W, grad_b (or group rows)
    n_b = n_v * n_groups * n_dc
    item = claim(ctr_ptr + 4)
    while item < n_b:
        if item == 0:
            store_scalar(loss_ptr, sum_vec(part_l_ptr, n_tiles, 1024) * scale)
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
            m_row, b_bad = ce_rows(b_t, m_n, ignore_index, C)
            b_lse = tl.load(lse_ptr + o_n, mask=m_n, other=0.0, cache_modifier=".cg")
            b_z = logits_tile(h_ptr, w_ptr, b_ptr, o_n, m_n, o_v, m_v, D, stride_h,
                               HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32, PRECISION, RELU)
            b_dz = tl.exp(b_z - b_lse[:, None]) - (o_v[None, :] == b_t[:, None]).to(tl.float32)
            # unscaled: the loss's scale multiplies the fp32 sums below (1 / N times a 16-bit dz underflows in fp16)
            b_dz = tl.where(m_row[:, None] & m_v[None, :], b_dz * (1.0 + b_bad)[:, None], 0.0)
            b_hd = relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_dc[None, :], mask=m_n[:, None] & m_dc[None, :],
                                    other=0.0), RELU)
            b_acc += tile_dot(tl.trans(b_dz).to(b_hd.dtype), b_hd, DOT_FP32, PRECISION)
            b_gb += tl.sum(b_dz, axis=0)
        b_acc = b_acc * gscale
        b_gb = b_gb * gscale
        o_w = o_v.to(tl.int64)[:, None] * D + o_dc[None, :]
        m_w = m_v[:, None] & m_dc[None, :]
        if n_groups == 1:
            store_grad(gw_ptr + o_w, b_acc, m_w, ACCUMULATE)
            if HAS_BIAS:
                if dc == 0:
                    store_grad(gb_ptr + o_v, b_gb, m_v, ACCUMULATE)
        else:
            p_row = part_ptr + g.to(tl.int64) * stride_g
            tl.store(p_row + o_w, b_acc, mask=m_w)
            if dc == 0:
                tl.store(p_row + C * D + o_v, b_gb, mask=m_v)
        item_done(ctr_ptr + 5)
        item = claim(ctr_ptr + 4)

    # ---- phase R (only with several row groups): fixed-order sum over groups
    if n_groups > 1:
        sum_group_rows(part_ptr, stride_g, n_groups, n_b, C, D, gw_ptr, gb_ptr, loss_ptr, scale, ctr_ptr,
                        HAS_BIAS, ACCUMULATE, BLOCK_G, BLOCK_R)
    exit_grid(ctr_ptr, n_programs, N_CTR)
