"""The small-vocabulary CE kernel: "ce" with 64 < C <= 512, one launch.

Phase A: per row tile, the C logits in registers (exact softmax), dz to an L2-resident
scratch in h's dtype, grad_h = dz W. Phase B: the GEMM grad_W = dz^T h split over output
tiles and row groups (split-K), so a grid of a few SMs still has work for every program;
phase R sums the group rows in a fixed order.
Reference: `erase_triton.reference.local_head`; tests: tests/test_small_ce.py, tests/test_local_head.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (claim, item_done, wait_all, exit_grid, count_targets, ce_rows, tile_dot, store_grad, sum_vec, sum_group_rows,
                     relu_in, relu_out, pad16, store_scalar, grad_scale)


@triton.jit(do_not_specialize=["N", "ignore_index", "n_tiles", "n_groups", "tiles_per_group", "n_programs"])
def small_ce_kernel(
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
        scale = count_targets(y_ptr, ctr_ptr, N, ignore_index, 1024)
    else:
        scale = inv_count
    gscale = grad_scale(scale)
    part_l_ptr = ws_ptr
    part_ptr = ws_ptr + pad16(n_tiles)
    n_gr = tl.where(n_groups > 1, n_groups, 0)
    dz_ptr = (part_ptr + n_gr.to(tl.int64) * stride_g).to(tl.pointer_type(gh_ptr.dtype.element_ty))
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C

    # ---- phase A: row tiles -> loss partial, dz, grad_h
    # Each program claims its next item when it starts one, so the claim's round trip to
    # L2 overlaps the item's work instead of preceding the next one.
    t = claim(ctr_ptr + 2)
    while t < n_tiles:
        t_next = claim(ctr_ptr + 2)
        o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
        m_n = o_n < N
        b_z = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        for k0 in tl.range(0, D, BLOCK_K, num_stages=NUM_STAGES):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < D
            b_h = relu_in(tl.load(h_ptr + o_n[:, None] * stride_h + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                                   other=0.0), RELU)
            if STORE_ACT:
                tl.store(act_ptr + o_n[:, None] * D + o_k[None, :], b_h, mask=m_n[:, None] & m_k[None, :])
            b_w = tl.load(w_ptr + o_c[:, None] * D + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0.0)
            b_z += tile_dot(b_h, tl.trans(b_w).to(b_h.dtype), DOT_FP32, PRECISION)
        # padded columns (c >= C) get -inf, with the bias in one vector add
        if HAS_BIAS:
            b_z += tl.load(b_ptr + o_c, mask=m_c, other=float("-inf")).to(tl.float32)[None, :]
        else:
            b_z += tl.where(m_c, 0.0, float("-inf"))[None, :]
        # one [BLOCK_N, BLOCK_C] fp32 tile live at a time (z, then e, then dz)
        b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
        m_row, b_bad = ce_rows(b_t, m_n, ignore_index, C)
        b_zt = tl.sum(tl.where(o_c[None, :] == b_t[:, None], b_z, 0.0), axis=1)
        b_max = tl.max(b_z, axis=1)
        b_z = tl.exp(b_z - b_max[:, None])
        b_s = tl.sum(b_z, axis=1)
        store_scalar(part_l_ptr + t, tl.sum(tl.where(m_row, b_max + tl.log(b_s) - b_zt, 0.0) + b_bad, axis=0))
        # dz without the loss's scale (it multiplies the fp32 products): 1 / N times a 16-bit dz underflows in fp16
        b_r = tl.where(m_row, 1.0, 0.0) + b_bad
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
                b_gh = tl.trans(tile_dot(b_wt.to(b_dz.dtype), b_dzt, DOT_FP32, PRECISION)) * gscale
            else:
                b_w = tl.load(w_ptr + o_c[:, None] * D + o_d[None, :], mask=m_c[:, None] & m_d[None, :], other=0.0)
                b_gh = tile_dot(b_dz, b_w.to(b_dz.dtype), DOT_FP32, PRECISION) * gscale
            if RELU:
                b_gh = relu_out(b_gh, tl.load(h_ptr + o_n[:, None] * stride_h + o_d[None, :],
                                               mask=m_n[:, None] & m_d[None, :], other=0.0), RELU)
            tl.store(gh_ptr + o_n[:, None] * D + o_d[None, :], b_gh.to(gh_ptr.dtype.element_ty),
                     mask=m_n[:, None] & m_d[None, :])
        item_done(ctr_ptr + 3)
        t = t_next
    wait_all(ctr_ptr + 3, n_tiles)

    if PHASES > 1:
        # ---- phase B: (output tile [BLOCK_CW, BLOCK_DW], row group) -> grad_W = dz^T h, grad_b
        n_dw = tl.cdiv(D, BLOCK_DW)
        n_b = tl.cdiv(C, BLOCK_CW) * n_dw * n_groups
        item = claim(ctr_ptr + 4)
        while item < n_b:
            item_next = claim(ctr_ptr + 4)
            if item == 0:
                store_scalar(loss_ptr, sum_vec(part_l_ptr, n_tiles, 1024) * scale)
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
                b_hd = relu_in(tl.load(h_ptr + o_r[:, None] * stride_h + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                                        other=0.0), RELU)
                b_acc += tile_dot(tl.trans(b_dz), b_hd.to(b_dz.dtype), DOT_FP32, PRECISION)
                if HAS_BIAS:  # elementwise: a sum over rows here is a cross-warp reduction an iteration
                    b_gb += b_dz.to(tl.float32)
            b_acc = b_acc * gscale
            o_w = o_v.to(tl.int64)[:, None] * D + o_d[None, :]
            m_w = m_v[:, None] & m_d[None, :]
            # (the group row's address is written out at each store: hoisting it into a variable
            # gives the fp32 variant 12-28 bytes of spills, compile_report.py)
            if n_groups == 1:
                store_grad(gw_ptr + o_w, b_acc, m_w, ACCUMULATE)
            else:
                tl.store(part_ptr + g.to(tl.int64) * stride_g + o_w, b_acc, mask=m_w)
            if HAS_BIAS:
                if dw == 0:
                    if n_groups == 1:
                        store_grad(gb_ptr + o_v, tl.sum(b_gb, axis=0) * gscale, m_v, ACCUMULATE)
                    else:
                        tl.store(part_ptr + g.to(tl.int64) * stride_g + C * D + o_v, tl.sum(b_gb, axis=0) * gscale, mask=m_v)
            item_done(ctr_ptr + 5)
            item = item_next

        # ---- phase R (only with several row groups): fixed-order sum over groups
        if PHASES > 2:
            if n_groups > 1:
                sum_group_rows(part_ptr, stride_g, n_groups, n_b, C, D, gw_ptr, gb_ptr, loss_ptr, scale, ctr_ptr,
                                HAS_BIAS, ACCUMULATE, BLOCK_G, BLOCK_R)
    exit_grid(ctr_ptr, n_programs, N_CTR)
