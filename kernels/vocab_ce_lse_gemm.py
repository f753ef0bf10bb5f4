"""The log-sum-exp pass of "cublas_vocab_chunks" as one Gluon kernel on Hopper: the logits GEMM with each row's
running base-2 max and sum in its epilogue, so the logits are never written and the pass is one launch (and a
merge) instead of a cuBLAS GEMM and a Triton kernel a chunk of classes.

  lse_gemm_kernel (a row tile x a split of the vocabulary; a program an SM), warp-specialized: a TMA warp
      loads the row tile's x once where it fits in shared memory beside the rings (D <= 512: `resident`), else
      with W's, and [128, 64] tiles of W; two consumer warpgroups take alternate [128, 128] tiles of the
      split's logits, each through its own ring of three stages, by asynchronous wgmma in fp32, each row's
      running base-2 max and sum and the target's logit (0 where its tiles lack it) in the epilogue: consumer
      c's as split 2 split + c of S, in merge_kernel's layout
  merge_kernel (vocab_ce_cublas.py; a block of rows): the splits merged in order: each row's base-2 lse,
      gradient factor and unscaled loss, where chunk_lse_kernel's last chunk leaves them

The two consumers are what hide one tile's epilogue (an exp2 an element) behind the other's wgmma: at
(4096, 512, 32000) bf16 on an H100 the pass took 0.241 ms, against 0.275 for one warpgroup a program with two
programs an SM and 0.39 with one, and cuBLAS' logits GEMM alone 0.22 (docs/tuning.md#vocabulary-ce-paths).
Holding x halves what the loads bring from L2 a tile (W's alone): 0.225 against 0.254 ms in one A/B. Each
consumer has its own ring because a shared one let a consumer's parity wait pass a phase that was not its
own: it read a stage before its load landed. Deterministic: a fixed order everywhere. Taken where `usable` says:
a CUDA device of compute capability 9.x (wgmma, TMA), bf16 x and W (the cublas paths' 16-bit dtype) with D a
multiple of 8, and x, W 16-byte aligned with unit stride on D (else the cuBLAS pass runs). Gluon does not run
in Triton's interpreter: on the CPU this module's kernel is only compiled (tests/test_vocab_ce.py), the merge
runs there.
"""
from __future__ import annotations

import torch

from .vocab_ce_cublas import LOG2E as _LOG2E, MERGE_BLOCK, merge_kernel

try:  # (Gluon: triton >= 3.5's experimental Hopper/Blackwell dialect)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - an older triton: the cuBLAS pass
    gluon = None

__all__ = ["ENABLED", "LseGemm", "lse_gemm_kernel", "resident", "usable"]

# switch for A/B runs (read when a call is prepared); the tile (rows, classes, K), stages a consumer, the default
# partition's warps; ptxas' register cap (12 warps x 168 fill the SM's 64K) and what the worker partitions take
# (the default partition gets the rest: 232)
ENABLED = True
TILE, STAGES, WARPS = (128, 128, 64), 3, 4
MAXNREG, CONSUMER_REGS, LOADER_REGS = 168, 232, 40
# the row tile's x held in shared memory for the whole program where it fits beside the rings (D <= 512), so
# the loads a tile are W's alone (switch for A/B runs); the shared memory a block may take on Hopper
RESIDENT, SMEM_BYTES = True, 227 * 1024


def resident(D: int) -> bool:
    """Whether a program holds its row tile's x (D wide) in shared memory beside the two rings of W."""
    BM, BN, BK = TILE
    # (bf16 tiles: 2 bytes an element; 1 KB for the barriers and the rest)
    return RESIDENT and 2 * (-(-D // BK) * BM * BK + 2 * STAGES * BN * BK) + 1024 <= SMEM_BYTES


def usable(device: torch.device, dtype: torch.dtype, D: int) -> bool:
    """Whether lse_gemm_kernel can serve a call of h's dtype and width D on `device`."""
    return (ENABLED and gluon is not None and device.type == "cuda" and dtype == torch.bfloat16 and D % 8 == 0
            and torch.cuda.get_device_capability(device)[0] == 9)


if gluon is not None:
    LOG2E = gl.constexpr(_LOG2E.value)  # (the Triton kernels' constant, as a Gluon one)
    _REGS = gl.constexpr([CONSUMER_REGS, LOADER_REGS])

    @gluon.jit
    def _consume(c: gl.constexpr, b_ptr, y_ptr, part_ptr, a_bufs, b_bufs, ready, empty, x_bar, r0, vt0, vt1,
                 split, S2, N, C, HAS_BIAS: gl.constexpr, KS: gl.constexpr, NB: gl.constexpr, BM: gl.constexpr,
                 BN: gl.constexpr, RESIDENT: gl.constexpr):
        # consumer warpgroup c: vocabulary tiles vt0 + c, vt0 + c + 2, ... from its own ring of NB stages (buffers
        # and barriers c NB + [0, NB): it waits on every phase of them, so a parity wait never skips one); its rows'
        # max, sum and target's logit as split 2 split + c of S2 (merge_kernel's [max | sum | logit] x S2 x N)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN, 16])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        n_tiles = vt1 - vt0
        rows = r0 + gl.arange(0, BM, layout=row_l)
        mr = rows < N
        t = gl.load(y_ptr + rows, mask=mr, other=-1).to(gl.int32)
        # (a target past this pass's classes, C, matches none of its columns: the last tile's masked ones are -inf)
        t = gl.where(t < C, t, -1)
        m = gl.full([BM], float("-inf"), gl.float32, layout=row_l)
        s = gl.zeros([BM], gl.float32, layout=row_l)
        zt = gl.zeros([BM], gl.float32, layout=row_l)
        acc = gl.zeros([BM, BN], gl.float32, layout=mma)
        if RESIDENT:  # the row tile's K steps, loaded once
            mbarrier.wait(x_bar.index(0), 0)
        for j in range(c, n_tiles, 2):
            for k in gl.static_range(KS):
                q = (j // 2) * KS + k
                st = c * NB + q % NB
                mbarrier.wait(ready.index(st), (q // NB) & 1)
                # (RESIDENT: step k as q % KS, which the compiler does not fold to k: a constant index hoists
                # the row tile's wgmma descriptors out of the loop, and the default partition spills them)
                a = a_bufs.index(q % KS) if RESIDENT else a_bufs.index(st)
                acc = warpgroup_mma(a, b_bufs.index(st).permute((1, 0)), acc, use_acc=k > 0, is_async=True)
                # the wgmma before this one is done: its stage back to the loader
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if k > 0:
                    mbarrier.arrive(empty.index(c * NB + (q - 1) % NB), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(c * NB + ((j // 2) * KS + KS - 1) % NB), count=1)
            c0 = (vt0 + j) * BN
            cols = c0 + gl.arange(0, BN, layout=col_l)
            mc = cols < C
            # the columns past C as -inf through the bias's add (or one of its own: a fresh z, not the loop's acc)
            if HAS_BIAS:
                z = acc + gl.load(b_ptr + cols, mask=mc, other=float("-inf")).to(gl.float32)[None, :]
            else:
                z = acc + gl.where(mc, 0.0, float("-inf"))[None, :]
            # the base-2 exponent as one FMA; the target's logit only where the tile holds a row's target, and
            # after the sums (before them, z held across the branch spilled)
            m_new = gl.maximum(m, gl.max(z, 1) * LOG2E)  # (finite: every tile holds a class)
            s = s * gl.exp2(m - m_new) + gl.sum(gl.exp2(gl.fma(z, LOG2E, -m_new[:, None])), 1)
            if gl.max(((t >= c0) & (t < c0 + BN)).to(gl.int32), 0) > 0:
                zt += gl.sum(gl.where(cols[None, :] == t[:, None], z, 0.0), 1)
            m = m_new
        off = (2 * split + c) * N + rows
        gl.store(part_ptr + off, m, mask=mr)
        gl.store(part_ptr + S2 * N + off, s, mask=mr)
        gl.store(part_ptr + 2 * S2 * N + off, zt, mask=mr)

    @gluon.jit
    def _consume0(b_ptr, y_ptr, part_ptr, a_bufs, b_bufs, ready, empty, x_bar, r0, vt0, vt1, split, S2, N, C,
                  HAS_BIAS: gl.constexpr, KS: gl.constexpr, NB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  RESIDENT: gl.constexpr):
        _consume(0, b_ptr, y_ptr, part_ptr, a_bufs, b_bufs, ready, empty, x_bar, r0, vt0, vt1, split, S2, N, C,
                 HAS_BIAS, KS, NB, BM, BN, RESIDENT)

    @gluon.jit
    def _consume1(b_ptr, y_ptr, part_ptr, a_bufs, b_bufs, ready, empty, x_bar, r0, vt0, vt1, split, S2, N, C,
                  HAS_BIAS: gl.constexpr, KS: gl.constexpr, NB: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  RESIDENT: gl.constexpr):
        _consume(1, b_ptr, y_ptr, part_ptr, a_bufs, b_bufs, ready, empty, x_bar, r0, vt0, vt1, split, S2, N, C,
                 HAS_BIAS, KS, NB, BM, BN, RESIDENT)

    @gluon.jit
    def _load(x_desc, w_desc, a_bufs, b_bufs, ready, empty, x_bar, r0, vt0, vt1, KS: gl.constexpr,
              NB: gl.constexpr, RESIDENT: gl.constexpr):
        # the TMA warp: tile j's K steps into consumer j % 2's ring, in tile order (RESIDENT: the row tile's K
        # steps once, first, and the rings W's alone)
        BK: gl.constexpr = x_desc.block_type.shape[1]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        if RESIDENT:
            mbarrier.expect(x_bar.index(0), KS * x_desc.block_type.nbytes)
            for i in range(KS):
                tma.async_copy_global_to_shared(x_desc, [r0, i * BK], x_bar.index(0), a_bufs.index(i))
        for p in range((vt1 - vt0) * KS):
            j = p // KS
            k = p % KS
            q = (j // 2) * KS + k
            st = (j % 2) * NB + q % NB
            mbarrier.wait(empty.index(st), ((q // NB) & 1) ^ 1)
            bar = ready.index(st)
            if RESIDENT:
                mbarrier.expect(bar, w_desc.block_type.nbytes)
            else:
                mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [r0, k * BK], bar, a_bufs.index(st))
            tma.async_copy_global_to_shared(w_desc, [(vt0 + j) * BN, k * BK], bar, b_bufs.index(st))

    @gluon.jit
    def lse_gemm_kernel(x_desc, w_desc, b_ptr, y_ptr, part_ptr, N, C, tiles_per,
                        HAS_BIAS: gl.constexpr, KS: gl.constexpr, NB: gl.constexpr, RESIDENT: gl.constexpr,
                        num_warps: gl.constexpr):
        # a row tile (pid 0) over the vocabulary tiles of split pid 1: a TMA warp and two consumer warpgroups (the
        # default partition and a worker) taking alternate tiles, one's epilogue beside the other's wgmma
        BM: gl.constexpr = x_desc.block_type.shape[0]
        BN: gl.constexpr = w_desc.block_type.shape[0]
        dtype: gl.constexpr = x_desc.dtype
        r0 = gl.program_id(0) * BM
        split = gl.program_id(1)
        S2 = 2 * gl.num_programs(1)
        vt0 = split * tiles_per
        vt1 = gl.minimum(vt0 + tiles_per, gl.cdiv(C, BN))
        # RESIDENT: the row tile's KS steps of x, held for the whole program; else x's own stages in the rings
        a_bufs = gl.allocate_shared_memory(dtype, [KS if RESIDENT else 2 * NB] + x_desc.block_type.shape,
                                           x_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [2 * NB] + w_desc.block_type.shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [2 * NB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2 * NB, 1], mbarrier.MBarrierLayout())
        x_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(x_bar.index(0), count=1)
        for j in gl.static_range(2 * NB):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=1)
        # (the argument tuples written out: a tuple held in a variable loses its constexprs)
        gl.warp_specialize([
            (_consume0, (b_ptr, y_ptr, part_ptr, a_bufs, b_bufs, ready, empty, x_bar, r0, vt0, vt1, split, S2,
                         N, C, HAS_BIAS, KS, NB, BM, BN, RESIDENT)),
            (_consume1, (b_ptr, y_ptr, part_ptr, a_bufs, b_bufs, ready, empty, x_bar, r0, vt0, vt1, split, S2,
                         N, C, HAS_BIAS, KS, NB, BM, BN, RESIDENT)),
            (_load, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, x_bar, r0, vt0, vt1, KS, NB, RESIDENT)),
        ], [4, 1], _REGS)
else:  # pragma: no cover
    lse_gemm_kernel = None


class LseGemm:
    """The pass for one prepared call: `splits` (S, the partial rows a row gets) and the fp32 scratch it needs
    (`n_part`: merge_kernel's 3 S N); called as (stream, x, weight, bias or None, y, scratch, scale, rows_loss,
    lse). launch: CublasCall.setup's, for the merge. classes: the GEMM's classes [0, classes) of C, the rest's
    running pair and target's logit already in lse and rows_loss (chunk_lse_kernel's; default: all C)."""

    __slots__ = ("N", "C", "D", "classes", "tiles_per", "splits", "has_bias", "layouts", "merge", "ignore_index",
                 "resident")

    def __init__(self, N: int, C: int, D: int, mean: bool, ignore_index: int, has_bias: bool, device: torch.device,
                 launch, y_example, classes: int | None = None):
        BM, BN, BK = TILE
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.classes = classes = C if classes is None else classes
        vt = -(-classes // BN)
        # a program an SM (224 KB of shared memory holding the row tile, 192 KB streaming it), in one wave where
        # the work allows (two waves took 0.246 against 0.241 ms at (4096, 512, 32000) on an H100); each
        # program's two consumers give two splits
        self.tiles_per = max(1, -(-vt * -(-N // BM) // sms))
        self.splits = 2 * -(-vt // self.tiles_per)
        self.N, self.C, self.D, self.has_bias, self.ignore_index = N, C, D, has_bias, ignore_index
        self.resident = resident(D)
        self.layouts = (gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16),
                        gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16))
        f32 = torch.float32
        self.merge = launch(merge_kernel, -(-N // MERGE_BLOCK),
                            dict(MEAN=mean, INIT=classes < C, BLOCK=MERGE_BLOCK, num_warps=4),
                            lambda: (f32, y_example, f32, f32, f32, self.splits, N, C, ignore_index))

    @property
    def n_part(self) -> int:
        return 3 * self.splits * self.N

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether TMA can read these x [N, D] and W [C, D] (16-byte aligned rows, unit stride on D)."""
        return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
                   for t in (x, weight))

    def __call__(self, stream, x, weight, bias, y, scratch, scale, rows_loss, lse):
        BM, BN, BK = TILE
        N, C, D, V = self.N, self.C, self.D, self.classes
        xd = TensorDescriptor(x, [N, D], [x.stride(0), 1], [BM, BK], self.layouts[0])
        wd = TensorDescriptor(weight, [V, D], [weight.stride(0), 1], [BN, BK], self.layouts[1])
        lse_gemm_kernel[(-(-N // BM), self.splits // 2)](xd, wd, bias if self.has_bias else weight, y, scratch, N,
                                                         V, self.tiles_per, HAS_BIAS=self.has_bias, KS=-(-D // BK),
                                                         NB=STAGES, RESIDENT=self.resident, num_warps=WARPS,
                                                         maxnreg=MAXNREG)
        self.merge(stream, scratch, y, scale, rows_loss, lse, self.splits, N, C, self.ignore_index)
