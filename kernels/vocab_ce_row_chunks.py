"""The row-chunked vocabulary CE kernel: "ce" with C > 512 as three GEMM passes, one launch.

The vocabulary-chunked kernel (vocab_ce_vocab_chunks.py) needs every row's log-sum-exp before its
first dz, so it computes the logits twice (four GEMMs). This one computes them once: it keeps the
softmax numerators of a chunk of rows, each tile against its own maximum, and turns them into dz in
place once the lse is known. Per chunk of `chunk` rows (host-sized: a scratch of 16 MiB to a quarter
of grad_W; one chunk where that holds all rows):

  E_r (vocabulary tile, row tile) -> z = h W^T; e = exp(z - max of the tile's row) into an
                                     [chunk, C] scratch in h's dtype; the tile's row max and sum of e
  S_r (row tile)                  -> lse of each row from its tiles' maxima and sums; the loss
  F_r (vocabulary tile, row tile) -> dz = e * exp(tile max - lse) - onehot(t) over e, in place; the
                                     tile's grad_b partial (fp32)
  G_r (row tile, D tile)          -> grad_h = dz W, K over the whole vocabulary
      (vocabulary tile, D tile)   -> grad_W += dz^T relu(h), K over the chunk's rows
  F_r is one read and write of the scratch; it leaves G_r plain GEMMs whose K loops only load (not
  exp and the row terms of every tile: docs/tuning.md#vocabulary-ce-paths). The loss's scale (1 / count for a mean)
  multiplies the fp32 accumulators, not dz: a 16-bit dz of a large vocabulary scaled by 1 / N would
  underflow in fp16.

grad_W is summed over the row chunks in its own dtype (a bf16 weight: one rounding a chunk; one
chunk: none); grad_b in an fp32 scratch. The work queue, stage barriers and determinism are those of
vocab_ce_vocab_chunks.py (common.wait_stage): one writer per output element, fixed-order sums.
Reference: `erase_triton.reference.local_head`; tests: tests/test_vocab_ce.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (claim, item_done, wait_stage, exit_grid, count_targets, ce_rows, tile_dot, sum_vec, relu_in, relu_out,
                     logits_tile, pad16, lse_and_loss, store_scalar, grad_scale, sum_rows)


@triton.jit
def _row_terms(y_ptr, lse_ptr, o_r, m_r, r0, ignore_index, C):
    # per row of a dz tile (rows o_r, global ids; chunk rows o_r - r0): the target, whether the row
    # counts, its factor (1 if it counts, 0 if not, NaN for a bad id) and its lse
    b_t = tl.load(y_ptr + o_r, mask=m_r, other=ignore_index)
    m_row, b_bad = ce_rows(b_t, m_r, ignore_index, C)
    b_lse = tl.load(lse_ptr + (o_r - r0), mask=m_r, other=0.0, cache_modifier=".cg")
    return b_t, m_row, tl.where(m_row, 1.0, 0.0) + b_bad, b_lse


@triton.jit
def _chunk_tile(q, rt, r0, r_hi, C, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    # item q of stage E_r or F_r: vocabulary tile v, row tile tr of the chunk at row r0; its rows (global
    # ids) and columns with their masks, and whether the tile has any row (the last chunk may be short)
    v = q // rt
    tr = q % rt
    o_n = r0 + tr * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    o_v = v * BLOCK_V + tl.arange(0, BLOCK_V)
    return v, tr, o_n, o_n < r_hi, o_v, o_v < C, r0 + tr * BLOCK_N < r_hi


@triton.jit
def _dz_tile(e_ptr, mt_ptr, o_r, m_r, o_v, m_v, b_t, m_row, b_rs, b_lse, chunk, C_PAD, v_tile, r0):
    # fp32 dz of rows o_r and columns o_v (all in vocabulary tile v_tile) from the stored numerators:
    # rs * (e * exp(tile max - lse) - onehot); zero where the row does not count
    o_c = o_r - r0
    b_f = tl.exp(tl.load(mt_ptr + v_tile * chunk + o_c, mask=m_r, other=0.0, cache_modifier=".cg") - b_lse) * b_rs
    b_e = tl.load(e_ptr + o_c[:, None] * C_PAD + o_v[None, :], mask=m_r[:, None] & m_v[None, :], other=0.0,
                  cache_modifier=".cg")  # (written by other programs: past L1)
    b_dz = b_e.to(tl.float32) * b_f[:, None] - tl.where(o_v[None, :] == b_t[:, None], b_rs[:, None], 0.0)
    return tl.where(m_row[:, None] & m_v[None, :], b_dz, 0.0)


@triton.jit(do_not_specialize=["N", "ignore_index", "n_tiles", "n_groups", "tiles_per_group", "n_programs"])
def vocab_ce_row_chunks_kernel(
    h_ptr,        # [N, D] input rows (unit stride along D)
    w_ptr,        # [C, D] head weight, contiguous
    b_ptr,        # [C] head bias (unused without HAS_BIAS)
    y_ptr,        # [N] int targets (ignore_index skips a row)
    gh_ptr,       # [N, D] out: grad_h, contiguous, h's dtype
    act_ptr,      # unused (the caller writes relu(h); same launch signature as the other kernels)
    gw_ptr,       # [C, D] out: grad_W, weight's dtype
    gb_ptr,       # [C] out: grad_b
    loss_ptr,     # [1] out: loss, fp32
    ws_ptr,       # fp32 workspace: tile max [n_v, chunk] | tile sum [n_v, chunk] | lse [chunk] | z_t [chunk]
                  #   | loss per row tile [n_tiles] | grad_b [C] and its partials [chunk / BLOCK_N, n_v * BLOCK_V]
                  #   (HAS_BIAS) | e, then dz [chunk, n_v * BLOCK_V] in h's dtype
                  #   (each region padded to 16 floats)
    acc_ptr,      # unused (the dense kernel's ATOMIC accumulator)
    ctr_ptr,      # [16] int32 workspace: counters, zero on entry and on exit
    N, D, C, stride_h,
    chunk,        # rows a chunk (a multiple of BLOCK_N; the stride_g slot of the signature)
    ignore_index, inv_count,
    n_tiles,      # row tiles of BLOCK_N
    n_groups, tiles_per_group,  # unused (the other kernels' row groups)
    n_programs,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, CE_MEAN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DC: tl.constexpr,
    BLOCK_P: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, N_CTR: tl.constexpr, RELU: tl.constexpr,
):
    tl.static_assert(BLOCK_V % BLOCK_K == 0, "a K step of grad_h must lie in one vocabulary tile")
    if CE_MEAN:
        scale = count_targets(y_ptr, ctr_ptr, N, ignore_index, 1024)
    else:
        scale = inv_count
    gscale = grad_scale(scale)
    dt = gh_ptr.dtype.element_ty
    n_v = tl.cdiv(C, BLOCK_V)
    C_PAD = n_v * BLOCK_V
    mt_ptr = ws_ptr
    st_ptr = mt_ptr + pad16(chunk * n_v)
    lse_ptr = st_ptr + pad16(chunk * n_v)
    zt_ptr = lse_ptr + pad16(chunk)
    part_l_ptr = zt_ptr + pad16(chunk)
    gb_acc_ptr = part_l_ptr + pad16(n_tiles)
    rt = chunk // BLOCK_N                   # row tiles a chunk
    gbp_ptr = gb_acc_ptr + pad16(C)
    if HAS_BIAS:
        e_ptr = (gbp_ptr + pad16(rt.to(tl.int64) * C_PAD)).to(tl.pointer_type(dt))
    else:
        e_ptr = gb_acc_ptr.to(tl.pointer_type(dt))

    n_d = tl.cdiv(D, BLOCK_DC)
    n_chunks = tl.cdiv(N, chunk)
    n_e = n_v * rt                          # stage E_r items (and F_r's)
    n_gh = rt * n_d                         # stage G_r: grad_h items ...
    n_gw = n_v * n_d                        # ... and grad_W items
    n_ef = n_e + rt + n_e                   # items of stages E_r, S_r, F_r
    n_stage = n_ef + n_gh + n_gw            # items of one chunk
    n_items = n_chunks * n_stage
    gh_first = C > chunk                    # the longer K first: the stage's tail is a short item

    passed = tl.full([], 0, tl.int32)  # the stage start this program has already waited for
    item = claim(ctr_ptr + 2)
    while item < n_items:
        r = item // n_stage
        q = item % n_stage
        r0 = r * chunk                      # first row of the chunk
        r_hi = tl.minimum(r0 + chunk, N)
        if q < n_e:
            # ---- stage E_r: numerators e = exp(z - row max) of one tile, the tile's row max and sum
            passed = wait_stage(ctr_ptr + 3, passed, r * n_stage)  # (the previous chunk is done with the scratch)
            v, tr, o_n, m_n, o_v, m_v, has_rows = _chunk_tile(q, rt, r0, r_hi, C, BLOCK_N, BLOCK_V)
            if has_rows:
                b_z = logits_tile(h_ptr, w_ptr, b_ptr, o_n, m_n, o_v, m_v, D, stride_h,
                                  HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32, PRECISION, RELU)
                b_z = tl.where(m_v[None, :], b_z, float("-inf"))
                b_m = tl.max(b_z, axis=1)
                b_e = tl.exp(b_z - b_m[:, None])
                o_c = o_n - r0
                tl.store(e_ptr + o_c[:, None] * C_PAD + o_v[None, :], b_e.to(dt), mask=m_n[:, None])
                tl.store(mt_ptr + v * chunk + o_c, b_m, mask=m_n)
                tl.store(st_ptr + v * chunk + o_c, tl.sum(b_e, axis=1), mask=m_n)
                b_t = tl.load(y_ptr + o_n, mask=m_n, other=ignore_index)
                m_t = m_n & (b_t >= v * BLOCK_V) & (b_t < v * BLOCK_V + BLOCK_V)  # one tile holds the target
                tl.store(zt_ptr + o_c, tl.sum(tl.where(o_v[None, :] == b_t[:, None], b_z, 0.0), axis=1), mask=m_t)
        elif q < n_e + rt:
            # ---- stage S_r: lse of a row tile (fixed tile order), its loss partial
            passed = wait_stage(ctr_ptr + 3, passed, r * n_stage + n_e)
            tr = q - n_e
            o_n = r0 + tr * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
            m_n = o_n < r_hi
            if r0 + tr * BLOCK_N < r_hi:
                lse_and_loss(mt_ptr, st_ptr, chunk, n_v, lse_ptr, zt_ptr, part_l_ptr + r * rt + tr, y_ptr, o_n, o_n - r0,
                             m_n, ignore_index, C, BLOCK_N, BLOCK_P)
        elif q < n_ef:
            # ---- stage F_r: dz of one tile over its numerators, the tile's grad_b partial
            passed = wait_stage(ctr_ptr + 3, passed, r * n_stage + n_e + rt)
            v, tr, o_n, m_n, o_v, m_v, has_rows = _chunk_tile(q - n_e - rt, rt, r0, r_hi, C, BLOCK_N, BLOCK_V)
            if has_rows:
                b_t, m_row, b_rs, b_lse = _row_terms(y_ptr, lse_ptr, o_n, m_n, r0, ignore_index, C)
                b_dz = _dz_tile(e_ptr, mt_ptr, o_n, m_n, o_v, m_v, b_t, m_row, b_rs, b_lse, chunk, C_PAD, v, r0)
                # every column of the padded tile (zero past C): the GEMMs' K loops read whole tiles
                tl.store(e_ptr + (o_n - r0)[:, None] * C_PAD + o_v[None, :], b_dz.to(dt), mask=m_n[:, None])
                if HAS_BIAS:
                    tl.store(gbp_ptr + tr.to(tl.int64) * C_PAD + o_v, tl.sum(b_dz, axis=0))
        else:
            passed = wait_stage(ctr_ptr + 3, passed, r * n_stage + n_ef)
            q = q - n_ef
            if r == n_chunks - 1:
                if q == 0:  # every row tile's loss partial is in (the last stage S is done)
                    store_scalar(loss_ptr, sum_vec(part_l_ptr, n_tiles, 1024) * scale)
            if gh_first:
                is_gh = q < n_gh
                q = tl.where(is_gh, q, q - n_gh)
            else:
                is_gh = q >= n_gw
                q = tl.where(is_gh, q - n_gw, q)
            if is_gh:
                # ---- stage G_r: grad_h[row tile, D tile d] = dz W[:, d], K over the vocabulary
                tr = q // n_d
                d = q % n_d
                o_n = r0 + tr * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
                m_n = o_n < r_hi
                if r0 + tr * BLOCK_N < r_hi:
                    o_dc = d * BLOCK_DC + tl.arange(0, BLOCK_DC)
                    m_dc = o_dc < D
                    m_nd = m_n[:, None] & m_dc[None, :]
                    b_acc = tl.zeros([BLOCK_N, BLOCK_DC], dtype=tl.float32)
                    for k0 in range(0, C, BLOCK_K):
                        o_k = k0 + tl.arange(0, BLOCK_K)
                        m_k = o_k < C
                        b_dz = tl.load(e_ptr + (o_n - r0)[:, None] * C_PAD + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                                       other=0.0, cache_modifier=".cg")  # (written by other programs: past L1)
                        b_w = tl.load(w_ptr + o_k.to(tl.int64)[:, None] * D + o_dc[None, :],
                                      mask=m_k[:, None] & m_dc[None, :], other=0.0)
                        b_acc += tile_dot(b_dz, b_w.to(dt), DOT_FP32, PRECISION)
                    b_acc = b_acc * gscale
                    if RELU:
                        b_acc = relu_out(b_acc, tl.load(h_ptr + o_n[:, None] * stride_h + o_dc[None, :],
                                                        mask=m_nd, other=0.0), RELU)
                    tl.store(gh_ptr + o_n[:, None] * D + o_dc[None, :], b_acc.to(dt), mask=m_nd)
            else:
                # ---- stage G_r: grad_W[vocabulary tile j, D tile d] (+)= dz^T relu(h), K over the chunk's rows
                j = q // n_d
                d = q % n_d
                o_v = j * BLOCK_V + tl.arange(0, BLOCK_V)
                m_v = o_v < C
                o_dc = d * BLOCK_DC + tl.arange(0, BLOCK_DC)
                m_dc = o_dc < D
                b_acc = tl.zeros([BLOCK_V, BLOCK_DC], dtype=tl.float32)
                for k0 in range(r0, r_hi, BLOCK_K):
                    o_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
                    m_k = o_k < r_hi
                    b_dz = tl.load(e_ptr + (o_k - r0)[:, None] * C_PAD + o_v[None, :], mask=m_k[:, None], other=0.0,
                                   cache_modifier=".cg")
                    b_hd = relu_in(tl.load(h_ptr + o_k[:, None] * stride_h + o_dc[None, :],
                                           mask=m_k[:, None] & m_dc[None, :], other=0.0), RELU)
                    b_acc += tile_dot(tl.trans(b_dz), b_hd.to(dt), DOT_FP32, PRECISION)
                b_acc = b_acc * gscale
                p_w = gw_ptr + o_v.to(tl.int64)[:, None] * D + o_dc[None, :]
                m_w = m_v[:, None] & m_dc[None, :]
                if ACCUMULATE:  # onto what .grad held, then onto the earlier chunks (another program's: .cg)
                    b_acc += tl.load(p_w, mask=m_w, other=0.0, cache_modifier=".cg").to(tl.float32)
                else:
                    if r > 0:
                        b_acc += tl.load(p_w, mask=m_w, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(p_w, b_acc.to(gw_ptr.dtype.element_ty), mask=m_w)
                if HAS_BIAS:
                    if d == 0:
                        # the chunk's row tiles' partials, fixed order
                        b_gb = sum_rows(gbp_ptr, tl.cdiv(r_hi - r0, BLOCK_N), C_PAD, o_v, m_v, BLOCK_P) * gscale
                        if r > 0:
                            b_gb += tl.load(gb_acc_ptr + o_v, mask=m_v, other=0.0, cache_modifier=".cg")
                        if r == n_chunks - 1:
                            if ACCUMULATE:
                                b_gb += tl.load(gb_ptr + o_v, mask=m_v, other=0.0, cache_modifier=".cg").to(tl.float32)
                            tl.store(gb_ptr + o_v, b_gb.to(gb_ptr.dtype.element_ty), mask=m_v)
                        else:
                            tl.store(gb_acc_ptr + o_v, b_gb, mask=m_v)
        item_done(ctr_ptr + 3)
        item = claim(ctr_ptr + 2)
    exit_grid(ctr_ptr, n_programs, N_CTR)
