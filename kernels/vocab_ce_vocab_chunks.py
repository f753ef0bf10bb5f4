"""The vocabulary-chunked CE kernel: "ce" with C > 512 as four GEMM passes, one launch.

The recompute kernel (vocab_ce.py) never writes anything of size N x C, and pays for it by
recomputing the logits once per D chunk of grad_h and of grad_W (about 2 * D / BLOCK_DC + 2 GEMMs
of 2·N·D·C flops). This one does four, each a plain tiled GEMM, in a bounded scratch (the
row-chunked kernel, vocab_ce_row_chunks.py, does three in a scratch of whole rows):

  L   (row tile, vocabulary split) -> running max and sum of exp over the split: z = h W^T
  M   (row tile)                       -> each row's lse from its splits (fixed order); the loss
  then, for each chunk of vocabulary columns (host-sized: a dz scratch of 16 MiB to a quarter of grad_W):
  D_c (row tile, vocabulary tile)  -> z again; dz = softmax(z) - onehot(t) into a
                                      [N, chunk] scratch in h's dtype; grad_b partials per row tile
                                      (the loss's scale multiplies the fp32 sums: scaled by 1 / N, a
                                      16-bit dz would underflow in fp16)
  G_c (vocabulary tile, D tile)    -> grad_W = dz^T relu(h), K over the N rows
      (row tile, D tile)           -> grad_h += dz W[chunk], K over the chunk (fp32 between chunks)

All stages share one work queue: a program claims the next item and, before the first item of a
stage, waits until every item of the stages before it is done (common.wait_stage: one cumulative
done counter; the claims are ordered, so every earlier item belongs to a running program: no
deadlock at any occupancy). In G_c the items with the longer K go first, so a stage ends on short ones. Every output element has one writer and every sum a fixed order: no float atomics,
bitwise reproducible. Reference: `erase_triton.reference.local_head`; tests: tests/test_vocab_ce.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (claim, item_done, wait_stage, exit_grid, count_targets, ce_rows, tile_dot, store_grad, sum_vec, relu_in,
                     relu_out, logits_tile, pad16, lse_and_loss, store_scalar, grad_scale, sum_rows)


@triton.jit(do_not_specialize=["N", "ignore_index", "n_tiles", "n_groups", "tiles_per_group", "n_programs"])
def vocab_ce_vocab_chunks_kernel(
    h_ptr,        # [N, D] input rows (unit stride along D)
    w_ptr,        # [C, D] head weight, contiguous
    b_ptr,        # [C] head bias (unused without HAS_BIAS)
    y_ptr,        # [N] int targets (ignore_index skips a row)
    gh_ptr,       # [N, D] out: grad_h, contiguous, h's dtype
    act_ptr,      # unused (the caller writes relu(h); same launch signature as the other kernels)
    gw_ptr,       # [C, D] out: grad_W, weight's dtype
    gb_ptr,       # [C] out: grad_b
    loss_ptr,     # [1] out: loss, fp32
    ws_ptr,       # fp32 workspace: max [S, N] | sum [S, N] | z_t [N] | lse [N] | loss per row tile [n_tiles]
                  #   | grad_b per row tile [n_tiles, chunk] (HAS_BIAS) | grad_h [N, D] (several chunks)
                  #   | dz [N, chunk] in h's dtype   (each region padded to 16 floats)
    acc_ptr,      # unused (the dense kernel's ATOMIC accumulator)
    ctr_ptr,      # [16] int32 workspace: counters, zero on entry and on exit
    N, D, C, stride_h,
    chunk,        # vocabulary columns a chunk (a multiple of BLOCK_V; the stride_g slot of the signature)
    ignore_index, inv_count,
    n_tiles,      # row tiles of BLOCK_N
    n_groups,     # S: vocabulary splits of stage L
    tiles_per_group,  # vocabulary tiles a split
    n_programs,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, CE_MEAN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DC: tl.constexpr,
    BLOCK_P: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, N_CTR: tl.constexpr, RELU: tl.constexpr,
):
    if CE_MEAN:
        scale = count_targets(y_ptr, ctr_ptr, N, ignore_index, 1024)
    else:
        scale = inv_count
    gscale = grad_scale(scale)
    S = n_groups
    m_ptr = ws_ptr
    s_ptr = m_ptr + pad16(S * N)
    zt_ptr = s_ptr + pad16(S * N)
    lse_ptr = zt_ptr + pad16(N)
    part_l_ptr = lse_ptr + pad16(N)
    gbp_ptr = part_l_ptr + pad16(n_tiles)
    if HAS_BIAS:
        acc_h_ptr = gbp_ptr + pad16(n_tiles.to(tl.int64) * chunk)
    else:
        acc_h_ptr = gbp_ptr
    n_chunks = tl.cdiv(C, chunk)
    n_acc_h = tl.where(n_chunks > 1, N.to(tl.int64) * D, 0)
    dz_ptr = (acc_h_ptr + pad16(n_acc_h)).to(tl.pointer_type(gh_ptr.dtype.element_ty))

    n_d = tl.cdiv(D, BLOCK_DC)
    n_vc = chunk // BLOCK_V                 # vocabulary tiles a chunk
    n_l = n_tiles * S                       # stage L items
    n_dz = n_tiles * n_vc                   # stage D_c items
    n_gw = n_vc * n_d                       # stage G_c: grad_W items (K: N rows) ...
    n_gh = n_tiles * n_d                    # ... and grad_h items (K: the chunk's columns)
    n_stage = n_dz + n_gw + n_gh            # items of one chunk (D_c then G_c)
    n_lm = n_l + n_tiles                    # stages L and M
    n_items = n_lm + n_chunks * n_stage
    gh_first = chunk > N                    # the longer K first

    passed = tl.full([], 0, tl.int32)  # the stage start this program has already waited for
    item = claim(ctr_ptr + 2)
    while item < n_items:
        if item < n_l:
            # ---- stage L: max and sum of exp of the logits over one vocabulary split
            t = item % n_tiles
            s = item // n_tiles
            o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
            m_n = o_n < N
            b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
            b_m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
            b_s = tl.zeros([BLOCK_N], dtype=tl.float32)
            b_zt = tl.zeros([BLOCK_N], dtype=tl.float32)
            v_lo = s * tiles_per_group * BLOCK_V
            v_hi = tl.minimum(v_lo + tiles_per_group * BLOCK_V, C)
            for v0 in range(v_lo, v_hi, BLOCK_V):
                o_v = v0 + tl.arange(0, BLOCK_V)
                m_v = o_v < C
                b_z = logits_tile(h_ptr, w_ptr, b_ptr, o_n, m_n, o_v, m_v, D, stride_h,
                                  HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32, PRECISION, RELU)
                b_z = tl.where(m_v[None, :], b_z, float("-inf"))
                b_zt += tl.sum(tl.where(o_v[None, :] == b_t[:, None], b_z, 0.0), axis=1)
                b_mnew = tl.maximum(b_m, tl.max(b_z, axis=1))
                b_s = b_s * tl.exp(b_m - b_mnew) + tl.sum(tl.exp(b_z - b_mnew[:, None]), axis=1)
                b_m = b_mnew
            tl.store(m_ptr + s * N + o_n, b_m, mask=m_n)
            tl.store(s_ptr + s * N + o_n, b_s, mask=m_n)
            # one split holds each row's target: it alone writes z_t
            tl.store(zt_ptr + o_n, b_zt, mask=m_n & (b_t >= v_lo) & (b_t < v_hi))
        elif item < n_lm:
            # ---- stage M: lse of a row tile from its splits, the tile's loss partial
            passed = wait_stage(ctr_ptr + 3, passed, n_l)
            t = item - n_l
            o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
            m_n = o_n < N
            lse_and_loss(m_ptr, s_ptr, N, S, lse_ptr, zt_ptr, part_l_ptr + t, y_ptr, o_n, o_n, m_n, ignore_index, C,
                         BLOCK_N, BLOCK_P)
        else:
            r = item - n_lm
            c = r // n_stage
            q = r % n_stage
            passed = wait_stage(ctr_ptr + 3, passed, n_lm + c * n_stage + tl.where(q < n_dz, 0, n_dz))
            c0 = c * chunk                   # first vocabulary column of the chunk
            c_hi = tl.minimum(c0 + chunk, C)
            if q < n_dz:
                # ---- stage D_c: dz of one [BLOCK_N, BLOCK_V] tile, its grad_b partial
                j = q // n_tiles
                t = q % n_tiles
                if j * BLOCK_V < c_hi - c0:  # (the last chunk may have fewer tiles)
                    o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
                    m_n = o_n < N
                    b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
                    m_row, b_bad = ce_rows(b_t, m_n, ignore_index, C)
                    b_lse = tl.load(lse_ptr + o_n, mask=m_n, other=0.0, cache_modifier=".cg")
                    o_j = j * BLOCK_V + tl.arange(0, BLOCK_V)   # column within the chunk
                    o_v = c0 + o_j
                    m_v = o_v < c_hi
                    b_z = logits_tile(h_ptr, w_ptr, b_ptr, o_n, m_n, o_v, m_v, D, stride_h,
                                      HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32, PRECISION, RELU)
                    b_dz = tl.exp(b_z - b_lse[:, None]) - (o_v[None, :] == b_t[:, None]).to(tl.float32)
                    # unscaled (the loss's scale multiplies the fp32 accumulators): scaled by 1 / N, a
                    # 16-bit dz of a large vocabulary would underflow in fp16
                    b_dz = tl.where(m_row[:, None] & m_v[None, :], b_dz * (1.0 + b_bad)[:, None], 0.0)
                    tl.store(dz_ptr + o_n[:, None] * chunk + o_j[None, :], b_dz.to(gh_ptr.dtype.element_ty),
                             mask=m_n[:, None])
                    if HAS_BIAS:
                        tl.store(gbp_ptr + t.to(tl.int64) * chunk + o_j, tl.sum(b_dz, axis=0) * gscale, mask=m_v)
            else:
                q = q - n_dz
                if c == 0:
                    if q == 0:  # every row tile's loss partial is in (stage M is done)
                        store_scalar(loss_ptr, sum_vec(part_l_ptr, n_tiles, 1024) * scale)
                if gh_first:
                    is_gw = q >= n_gh
                    q = tl.where(is_gw, q - n_gh, q)
                else:
                    is_gw = q < n_gw
                    q = tl.where(is_gw, q, q - n_gw)
                if is_gw:
                    # ---- stage G_c: grad_W[chunk tile j, D tile d] = dz[:, j]^T relu(h[:, d])
                    j = q // n_d
                    d = q % n_d
                    if j * BLOCK_V < c_hi - c0:
                        o_j = j * BLOCK_V + tl.arange(0, BLOCK_V)
                        o_v = c0 + o_j
                        m_v = o_v < c_hi
                        o_dc = d * BLOCK_DC + tl.arange(0, BLOCK_DC)
                        m_dc = o_dc < D
                        b_acc = tl.zeros([BLOCK_V, BLOCK_DC], dtype=tl.float32)
                        for k0 in range(0, N, BLOCK_K):
                            o_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
                            m_k = o_k < N
                            b_dz = tl.load(dz_ptr + o_k[:, None] * chunk + o_j[None, :], mask=m_k[:, None], other=0.0,
                                           cache_modifier=".cg")  # (written by other programs: past L1)
                            b_hd = relu_in(tl.load(h_ptr + o_k[:, None] * stride_h + o_dc[None, :],
                                                   mask=m_k[:, None] & m_dc[None, :], other=0.0), RELU)
                            b_acc += tile_dot(tl.trans(b_dz), b_hd.to(b_dz.dtype), DOT_FP32, PRECISION)
                        store_grad(gw_ptr + o_v.to(tl.int64)[:, None] * D + o_dc[None, :], b_acc * gscale,
                                   m_v[:, None] & m_dc[None, :], ACCUMULATE)
                        if HAS_BIAS:
                            if d == 0:  # the row tiles' partials, fixed order
                                store_grad(gb_ptr + o_v, sum_rows(gbp_ptr, n_tiles, chunk, o_j, m_v, BLOCK_P), m_v,
                                           ACCUMULATE)
                else:
                    # ---- stage G_c: grad_h[row tile t, D tile d] += dz[t, chunk] W[chunk, d]
                    t = q // n_d
                    d = q % n_d
                    o_n = tl.arange(0, BLOCK_N).to(tl.int64) + t * BLOCK_N
                    m_n = o_n < N
                    o_dc = d * BLOCK_DC + tl.arange(0, BLOCK_DC)
                    m_dc = o_dc < D
                    m_nd = m_n[:, None] & m_dc[None, :]
                    b_acc = tl.zeros([BLOCK_N, BLOCK_DC], dtype=tl.float32)
                    for k0 in range(0, c_hi - c0, BLOCK_K):
                        o_k = k0 + tl.arange(0, BLOCK_K)
                        m_k = o_k < c_hi - c0
                        b_dz = tl.load(dz_ptr + o_n[:, None] * chunk + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                                       other=0.0, cache_modifier=".cg")
                        b_w = tl.load(w_ptr + (c0 + o_k).to(tl.int64)[:, None] * D + o_dc[None, :],
                                      mask=m_k[:, None] & m_dc[None, :], other=0.0)
                        b_acc += tile_dot(b_dz, b_w.to(b_dz.dtype), DOT_FP32, PRECISION)
                    b_acc = b_acc * gscale
                    o_nd = o_n[:, None] * D + o_dc[None, :]
                    if c > 0:
                        b_acc += tl.load(acc_h_ptr + o_nd, mask=m_nd, other=0.0, cache_modifier=".cg")
                    if c == n_chunks - 1:
                        if RELU:
                            b_acc = relu_out(b_acc, tl.load(h_ptr + o_n[:, None] * stride_h + o_dc[None, :],
                                                            mask=m_nd, other=0.0), RELU)
                        tl.store(gh_ptr + o_nd, b_acc.to(gh_ptr.dtype.element_ty), mask=m_nd)
                    else:
                        tl.store(acc_h_ptr + o_nd, b_acc, mask=m_nd)
        item_done(ctr_ptr + 3)
        item = claim(ctr_ptr + 2)
    exit_grid(ctr_ptr, n_programs, N_CTR)
