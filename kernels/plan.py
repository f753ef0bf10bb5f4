"""Host side of the head kernels: which kernel and tiles a call takes (the plan), the
per-stream workspace, the persistent grid, and the launch itself.

`prepare_launch` builds a `HeadLaunch` once per call signature; calling it allocates
grad_h and the loss and launches one kernel. Why each tile constant: docs/tuning.md.
"""
from __future__ import annotations

import dataclasses
import inspect
import os

import torch

from .common import N_CTR as _N_CTR
from .dense_head import dense_head_kernel
from .launch import CUBLAS_PATHS, LaunchConfig, interpreting, next_pow2, num_programs
from .small_ce import small_ce_kernel
from .vocab_ce import vocab_ce_kernel
from .direct import direct_launcher
from .vocab_ce_cublas import CublasLaunch, check_cublas_inputs
from .vocab_ce_cublas_in_place import CublasInPlaceLaunch
from .vocab_ce_cublas_vocab_chunks import CublasVocabLaunch
from .vocab_ce_row_chunks import vocab_ce_row_chunks_kernel
from .vocab_ce_vocab_chunks import vocab_ce_vocab_chunks_kernel

__all__ = ["HeadLaunch", "KERNELS", "LOSSES", "MAX_DENSE_C", "MAX_VOCAB", "chunk_size_for", "plan_for", "prepare_launch"]

LOSSES = {"bce": 0, "ce": 1, "mse": 2}
MAX_DENSE_C = 64
DENSE_CE_MAX_C = 64  # "ce" up to here: the dense kernel (docs/tuning.md#ce-kernel-thresholds)
SMALL_CE_MAX_C = 512  # up to here the small-vocabulary kernel, above it the vocabulary kernel (same section)
MAX_VOCAB = 131072
# the head kernels by plan kind (`_Plan.kind`)
KERNELS = {"dense": dense_head_kernel, "small": small_ce_kernel, "vocab": vocab_ce_kernel,
           "vocab_chunks": vocab_ce_vocab_chunks_kernel, "row_chunks": vocab_ce_row_chunks_kernel}


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
        # whole rows in one tile: h read once, W once per program (docs/tuning.md#dense-head-tiles)
        bd = max(dp, 16)
    else:
        bd = 128
    rows_c1 = bd >= D and block_c == 1 and bd >= 512  # long whole rows, no tl.dot: a bandwidth-bound stream
    maxnreg = None  # ptxas' register cap (LaunchConfig.max_registers overrides)
    if rows_c1:
        # a bandwidth-bound stream: 8 rows of 1024 on 2 warps, pipelined; fp32 rows of 2048+ half
        # the tile on 4 warps (docs/tuning.md#dense-head-tiles)
        half = esize == 4 and bd >= 2048
        bn = cfg.block_n or max(1, min(8, (4096 if half else 8192) // bd))
        warps, stages = (4, 1) if half else (2, 2)
        # beside another stream, 128 registers fit 8 programs an SM instead of 5 (fp32 only;
        # docs/tuning.md#dense-head-tiles)
        if esize == 4 and bd == 512 and cfg.occupancy is not None and cfg.occupancy < 1:
            maxnreg = 128  # (CUDA launches only: `plan_for` drops it under the interpreter)
    elif bd >= D and block_c == 1:
        # short whole rows (launch-bound sizes): more, smaller tiles, unpipelined (docs/tuning.md#dense-head-tiles)
        bn = cfg.block_n or max(16, min(128, 4096 // bd))
        warps, stages = 4, 1
    else:
        bn = cfg.block_n or (max(16, min(128, 16384 // bd)) if bd >= D else 64)
        # 4 warps beat 8 for whole-row tiles (docs/tuning.md#dense-head-tiles)
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
    # Not deterministic and the weight in one tile: float atomics into ACC_COPIES accumulators replace
    # the barrier and phase R, and the row tiles are split statically (STRIDED: no claims);
    # LaunchConfig(group_tiles=k) keeps claimed groups of k tiles (docs/tuning.md#atomic-or-deterministic-sums)
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


def _check_dot_rows(cfg: LaunchConfig, kernel: str) -> None:
    if cfg.block_n is not None and cfg.block_n < 16:
        raise ValueError(f"block_n must be >= 16 for {kernel} (tl.dot tiles), got {cfg.block_n}")


def _small_ce_blocks(D: int, C: int, cfg: LaunchConfig, cuda: bool, esize: int) -> dict:
    dp = max(next_pow2(D), 16)
    block_c = max(16, next_pow2(C))
    _check_dot_rows(cfg, "the small-vocabulary CE kernel")
    if cuda:
        # phase A: 64-row tiles, chunks of 64 (fp32: 32, to fit shared memory), 3 stages; phase B:
        # [128, 128] grad_W tiles over 64-row steps (docs/tuning.md#small-vocabulary-ce-tiles)
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
    # GH_T (16-bit inputs, C <= 256): grad_h^T = W^T dz^T with dz^T as wgmma's shared-memory operand
    # (docs/tuning.md#small-vocabulary-ce-tiles)
    return dict(NUM_STAGES=stages, BLOCK_N=bn, BLOCK_C=block_c, BLOCK_K=bk, BLOCK_DC=bdc,
                BLOCK_CW=min(bcw, block_c), BLOCK_DW=bdw, BLOCK_KW=bkw, BLOCK_G=2, BLOCK_R=2048, PHASES=3,
                GH_T=esize <= 2 and block_c <= 256, num_warps=warps)


def _vocab_blocks(D: int, cfg: LaunchConfig, cuda: bool) -> dict:
    dp = max(next_pow2(D), 16)
    _check_dot_rows(cfg, "the vocabulary kernel")
    if cuda:
        bn, bv, bdc, bk = cfg.block_n or 64, cfg.block_v or 128, cfg.block_d or min(dp, 256), min(dp, 64)
    else:  # interpreter: fewer, bigger tiles
        bn, bv, bdc, bk = cfg.block_n or 128, cfg.block_v or 512, cfg.block_d or min(dp, 256), min(dp, 256)
    # phase R (few vocabulary tiles: rows split into G groups, G ~ programs / vocabulary tiles, so
    # small at low occupancy): 8 group rows x 512 columns a load. With 64 x 64 a C=256 D=256 head
    # at occupancy 1/8 (16 programs, G = 8) took 1028 latency-bound items, 64 rounds a program.
    return dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, BLOCK_DC=bdc, BLOCK_G=8, BLOCK_R=512,
                num_warps=cfg.num_warps or 8, num_stages=cfg.num_stages if cuda else None)


def _chunked_blocks(cfg: LaunchConfig, cuda: bool) -> dict:
    # the chunked vocabulary kernels: every stage a [128, 128] GEMM tile with K steps of 64 (the wgmma
    # shape of a plain Triton GEMM); the interpreter takes bigger steps (fewer Python-level ops)
    _check_dot_rows(cfg, "the vocabulary kernel")
    bv = cfg.block_v or 128
    return dict(BLOCK_N=cfg.block_n or 128, BLOCK_V=bv, BLOCK_K=min(64 if cuda else 128, bv),
                BLOCK_DC=cfg.block_d or 128, BLOCK_P=32, num_warps=cfg.num_warps or 8,
                num_stages=cfg.num_stages if cuda else None)


# vocab_path=None: "row_chunks" from this D up, else "vocab_chunks". Below it row_chunks' chunk must hold
# ~SMs x 128 x 128 / D rows to give every program a grad_h tile, several times vocab_chunks' scratch
# (D = 512: 298 against 62 MB); at D = 4096 both hold ~1.3 GB (docs/tuning.md#vocabulary-ce-paths)
VOCAB_ROW_CHUNKS_MIN_D = 2048


def default_vocab_path(D: int) -> str:
    """The Triton vocabulary CE kernel a launch with vocab_path=None takes where "cublas" does not apply
    (`vocab_path_for`), by the width D of h."""
    return "row_chunks" if D >= VOCAB_ROW_CHUNKS_MIN_D else "vocab_chunks"


# LaunchConfig fields that only tune the Triton kernels: setting one keeps vocab_path=None on them
_TRITON_ONLY_FIELDS = ("block_n", "block_d", "num_warps", "num_stages", "group_tiles", "programs_per_sm",
                       "max_registers", "fp32_precision")


def vocab_path_for(cfg: LaunchConfig, D: int, dtypes: tuple, cuda: bool, N: int | None = None,
                   accumulate: bool = True) -> str:
    """The vocabulary CE path of a launch: cfg.vocab_path where set; else "cublas" on CUDA where every
    one of `dtypes` (h, weight, bias: None where absent) is bf16, at full occupancy
    (2.1x and 1.9x the Triton paths' speed at D = 512 and 4096 on an H200, docs/tuning.md#vocabulary-ce-paths),
    unless a Triton-only field is set or torch's deterministic mode would refuse cuBLAS (no
    CUBLAS_WORKSPACE_CONFIG); of those, "cublas_in_place" where its inputs allow it (N rows at most D, no
    existing gradient to add to: `accumulate` False, no cfg.chunk_size); else `default_vocab_path(D)`."""
    if cfg.vocab_path:
        return cfg.vocab_path
    if (cuda and all(d in (None, torch.bfloat16) for d in dtypes) and dtypes[0] is not None
            and cfg.occupancy in (None, 1.0) and all(getattr(cfg, f) is None for f in _TRITON_ONLY_FIELDS)
            and not (torch.are_deterministic_algorithms_enabled()
                     and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"))):
        # in place: 3% faster in 22% less memory at (4096, 4096, 128256) on an H100, outputs rounded once (tuning.md)
        in_place = N is not None and in_place_refusal(N, D, accumulate) is None and cfg.chunk_size is None
        return "cublas_in_place" if in_place else "cublas"
    return default_vocab_path(D)


def in_place_refusal(N: int, D: int, accumulate: bool) -> str | None:
    """Why vocab_path="cublas_in_place" cannot take a call (a message naming the fix), or None where it can:
    the rule's test and prepare_launch's refusal, from one place."""
    if N > D:
        return (f"vocab_path='cublas_in_place' holds the N x C logits in grad_W's C x D memory, so it takes at "
                f"most D = {D} rows, got N = {N}; use vocab_path='cublas'")
    if accumulate:
        return ("vocab_path='cublas_in_place' writes the logits into grad_W's memory, so it cannot add to an "
                "existing gradient (accumulate=True: the weight's .grad is set); zero_grad(set_to_none=True) "
                "first, or use vocab_path='cublas'")
    return None


_L_ITEMS_PER_PROGRAM = 8  # vocab_chunks' stage L: a tail of at most ~1/8 of the stage
_CHUNK_MIN_BYTES = 16 << 20  # scratch of the chunked vocabulary paths: at least this, at most a share of grad_W
# vocab_path="cublas": rows a chunk at least (GEMMs of at least 8 row tiles of 128; not tuned), their rounding, and
# its scratch: up to 3/8 of grad_W's bytes, chunks not evened out. At (4096, 4096, 128256) that is 1536 + 1536 + 1024
# rows, within 1.5 GB, and in interleaved rounds 2% faster than 4 x 1024 on an H200, level on an H100; 2 x 2048 is
# 2-3% faster in 1.53 GB (docs/tuning.md#vocabulary-ce-paths)
CUBLAS_MIN_ROWS, CUBLAS_ROW_TILE, CUBLAS_SCRATCH_SHARE = 1024, 64, 3 / 8
# vocab_path="cublas_vocab_chunks": classes a chunk in 128s, a scratch of up to 7/8 of grad_W's bytes, evened out
# over the chunks: 10 x 3200 at (4096, 512, 32000), 25 MiB, 67.5 MiB a call in all where cuBLAS ran before. On an
# H100 that took 1.08 ms of kernel time against 1.15 for 10 x 3072 + 1280 (a short last chunk), and 1.12 for
# 12 x 2688 within 64 MiB (docs/tuning.md#vocabulary-ce-paths)
CUBLAS_COLUMN_TILE, CUBLAS_VOCAB_SCRATCH_SHARE = 128, 7 / 8
# vocab_path="cublas_in_place": classes a block of grad_W (the [block, N] scratch's rows): at (4096, 4096, 128256)
# 2048 took 19.0 ms of kernel time against 4096's 19.4 (H100, one probe; docs/tuning.md#vocabulary-ce-paths)
CUBLAS_IN_PLACE_BLOCK = 2048


def chunk_size_for(path: str, N: int, C: int, D: int, h_size: int, w_size: int, tile: int, cfg: LaunchConfig,
                   least: int = 0, share: float = 1 / 4, even: bool = True) -> int:
    """Columns ("vocab_chunks", "cublas_vocab_chunks") or rows ("row_chunks", "cublas") a chunk: cfg.chunk_size
    rounded up to `tile`, else as many as a scratch of max(16 MiB, `share` of grad_W's bytes) holds or `least` if
    more, then (`even`) evened out over the chunks that makes; never more than the whole (padded) extent."""
    whole, across = (C, N) if path.endswith("vocab_chunks") else (N, _cdiv(C, tile) * tile)
    whole_pad = _cdiv(whole, tile) * tile
    if cfg.chunk_size:
        return min(_cdiv(cfg.chunk_size, tile) * tile, whole_pad)
    budget = max(_CHUNK_MIN_BYTES, int(C * D * w_size * share))
    most = max(tile, least, budget // (max(across, 1) * h_size) // tile * tile)
    if not even:
        return min(most, whole_pad)
    n_chunks = _cdiv(whole, most)
    return min(_cdiv(_cdiv(whole, n_chunks), tile) * tile, whole_pad)


class _Plan:
    """Everything about a launch that does not depend on N, computed once per key."""

    __slots__ = ("kernel", "kind", "constexprs", "opts", "p_occ")

    def __init__(self, kernel, kind, constexprs, num_warps, maxnreg=None, num_stages=None):
        self.kernel, self.kind, self.constexprs = kernel, kind, constexprs
        # compile options of every launch: num_warps, ptxas' register cap and the pipelining depth where set
        self.opts = dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
                         **({"num_stages": num_stages} if num_stages else {}))
        self.p_occ = None

    @property
    def num_warps(self) -> int:
        return self.opts["num_warps"]


_PLANS: dict = {}


def _cdiv(a: int, b: int) -> int:
    # not triton.cdiv: a @jit function, slow to call from the host (docs/tuning.md#host-path)
    return -(-a // b)


def _pad16(n: int) -> int:
    # a workspace region rounded up to 16 floats (the kernels' `common.pad16`)
    return _cdiv(n, 16) * 16


def plan_for(loss, reduction, C, D, h_dtype, has_bias, accumulate, cfg, cuda, dot_fp32, precision,
          deterministic: bool = True, relu: bool = False, store_act: bool = False) -> _Plan:
    key = (loss, reduction, C, D, h_dtype, has_bias, accumulate, cfg, cuda, dot_fp32, precision, relu, store_act,
           deterministic)
    p = _PLANS.get(key)
    if p is not None:
        return p
    kind = "dense" if loss != "ce" or C <= DENSE_CE_MAX_C else ("small" if C <= SMALL_CE_MAX_C else "vocab")
    if kind == "vocab":
        kind = cfg.vocab_path or default_vocab_path(D)
        kind = "vocab" if kind == "recompute" else kind
        if kind in CUBLAS_PATHS:
            raise ValueError(f"vocab_path={kind!r} is not one Triton kernel: prepare_launch builds its launch")
    if kind == "dense":
        blk = _dense_blocks(D, C, cfg, cuda, deterministic, h_dtype.itemsize)
    elif kind == "small":
        blk = _small_ce_blocks(D, C, cfg, cuda, h_dtype.itemsize)
    elif kind == "vocab":
        blk = _vocab_blocks(D, cfg, cuda)
    else:
        blk = _chunked_blocks(cfg, cuda)
    num_warps = blk.pop("num_warps")
    maxnreg = blk.pop("maxnreg", None)
    num_stages = blk.pop("num_stages", None)  # the vocabulary kernels: a compile option (their K loops)
    # STORE_ACT: the dense and small CE kernels write relu(h) as they read h; the vocabulary
    # kernels read h once per vocabulary tile and have no such output (the caller applies the ReLU)
    cx = dict(HAS_BIAS=has_bias, ACCUMULATE=accumulate, DOT_FP32=dot_fp32, PRECISION=precision, N_CTR=_N_CTR,
              RELU=relu, STORE_ACT=store_act and kind in ("dense", "small"), **blk)
    if kind == "dense":
        cx.update(LOSS=LOSSES[loss], CE_MEAN=(loss == "ce" and reduction == "mean"))
    else:
        cx.update(CE_MEAN=reduction == "mean")
    kernel = KERNELS[kind]
    names = [n for n, q in inspect.signature(kernel.fn).parameters.items() if "constexpr" in str(q.annotation)]
    cx = {k: cx[k] for k in names}  # declaration order: the direct launcher passes them positionally
    p = _PLANS[key] = _Plan(kernel, kind, cx, num_warps, (cfg.max_registers or maxnreg) if cuda else None, num_stages)
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


def prepare_launch(h2, weight, bias, y, loss: str, reduction: str, ignore_index: int, cfg: LaunchConfig,
                   grad_weight: torch.Tensor, grad_bias, accumulate: bool, relu: bool = False,
                   store_act: bool = False) -> HeadLaunch:
    """Plan one launch for h2 [N, D] (unit stride on D) and y ([N, C] float or [N] int).
    relu: the head reads relu(h2) and grad_h is the gradient at the ReLU's input.
    store_act: the kernel also writes relu(h2) where it can (`HeadLaunch.store_act` says).
    A CE head with C > SMALL_CE_MAX_C on vocab_path="cublas" (named, or `vocab_path_for`'s choice) gets a
    `CublasLaunch`, on "cublas_vocab_chunks" a `CublasVocabLaunch`, on "cublas_in_place" a `CublasInPlaceLaunch`
    (all called alike)."""
    N, D = h2.shape
    C = weight.shape[0]
    dev = h2.device
    cuda = dev.type == "cuda"
    if cuda and _device_index(dev) != torch.cuda.current_device():
        raise ValueError(f"h is on {dev} but the current CUDA device is cuda:{torch.cuda.current_device()}; "
                         f"call torch.cuda.set_device({dev}) or use `with torch.cuda.device(...)`")
    if loss == "ce" and C > SMALL_CE_MAX_C:  # a vocabulary head: the rule's path, by name from here
        if cfg.vocab_path is None:
            dtypes = (h2.dtype, weight.dtype, bias.dtype if bias is not None else None)
            cfg = dataclasses.replace(cfg, vocab_path=vocab_path_for(cfg, D, dtypes, cuda, N, accumulate))
        if cfg.vocab_path in CUBLAS_PATHS:
            check_cublas_inputs(h2, weight, bias, cfg)
            mean, example = reduction == "mean", (h2.dtype, bias, y, grad_bias) if cuda else None
            if cfg.vocab_path == "cublas_in_place":
                refusal = in_place_refusal(N, D, accumulate)
                if refusal:
                    raise ValueError(refusal)
                hl = CublasInPlaceLaunch(N, C, D, cfg.chunk_size or CUBLAS_IN_PLACE_BLOCK, mean, ignore_index, relu,
                                         bias is not None, dev, POISON, example=example)
            elif cfg.vocab_path == "cublas":
                chunk = chunk_size_for("cublas", N, C, D, h2.element_size(), weight.element_size(), CUBLAS_ROW_TILE,
                                       cfg, least=CUBLAS_MIN_ROWS, share=CUBLAS_SCRATCH_SHARE, even=False)
                hl = CublasLaunch(N, C, chunk, mean, ignore_index, relu, accumulate, bias is not None, dev, POISON,
                                  cfg.two_pass, cfg.block_v, example=example)
            else:
                chunk = chunk_size_for("cublas_vocab_chunks", N, C, D, h2.element_size(), weight.element_size(),
                                       CUBLAS_COLUMN_TILE, cfg, share=CUBLAS_VOCAB_SCRATCH_SHARE)
                hl = CublasVocabLaunch(N, C, chunk, mean, ignore_index, relu, accumulate, bias is not None, dev,
                                       POISON, cfg.block_v, example=example, D=D)
            # recorded like a Triton plan, so what a call took shows in _PLANS (the tests read the kinds)
            _PLANS.setdefault((cfg.vocab_path, reduction, C, D, h2.dtype, bias is not None, accumulate, cfg, cuda,
                               relu), _Plan(hl.kernel, cfg.vocab_path, hl.constexprs, hl.num_warps))
            return hl
    ws = _workspace(dev)
    has_bias = bias is not None
    dot_fp32 = interpreting()
    precision = "ieee"
    if not dot_fp32 and h2.dtype == torch.float32:
        precision = cfg.fp32_precision or ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
    deterministic = cfg.deterministic if cfg.deterministic is not None else torch.are_deterministic_algorithms_enabled()
    plan = plan_for(loss, reduction, C, D, h2.dtype, has_bias, accumulate, cfg, cuda, dot_fp32, precision, deterministic,
                 relu, store_act and relu)
    cx = plan.constexprs
    if plan.kind == "dense" and cx["STRIDED"] and not cx["ATOMIC"]:
        # a static tile split needs no claims only where no grid barrier waits on other programs
        raise ValueError("STRIDED row tiles need the ATOMIC (non-deterministic, one weight tile) dense kernel")
    b_arg = bias if has_bias else weight
    gb_arg = grad_bias if has_bias else grad_weight
    bn = cx["BLOCK_N"]
    n_tiles = _cdiv(N, bn)
    stride_g = _pad16(C * D + C + 1)

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
        n_buf = _pad16(n_tiles) + (G * stride_g if G > 1 else 0) + dz_floats
        n_acc = 0
    elif plan.kind in ("vocab_chunks", "row_chunks"):
        inv_count = 1.0
        bv = cx["BLOCK_V"]
        n_v = _cdiv(C, bv)
        n_d = _cdiv(D, cx["BLOCK_DC"])
        tile = bv if plan.kind == "vocab_chunks" else bn
        # row_chunks: at least enough rows that the grad_h items (row tile, D tile; K: the whole
        # vocabulary, the stage's longest) fill the grid, or a few long items end every chunk alone
        least = 0 if plan.kind == "vocab_chunks" else _cdiv(p_occ, n_d) * bn
        chunk = chunk_size_for(plan.kind, N, C, D, h2.element_size(), weight.element_size(), tile, cfg, least)
        if plan.kind == "vocab_chunks":
            # stage L: (row tile, vocabulary split) items, about 8 a program: the stage's tail is short
            G = max(1, min(n_v, _cdiv(_L_ITEMS_PER_PROGRAM * p_occ, n_tiles)))
            tpg = _cdiv(n_v, G)
            G = _cdiv(n_v, tpg)
            n_chunks = _cdiv(C, chunk)
            P = min(p_occ, max(n_tiles * G, n_tiles * (chunk // bv) + (chunk // bv) * n_d + n_tiles * n_d))
            n_buf = (2 * _pad16(G * N) + 2 * _pad16(N) + _pad16(n_tiles) + (_pad16(n_tiles * chunk) if has_bias else 0)
                     + (_pad16(N * D) if n_chunks > 1 else 0) + _cdiv(N * chunk * h2.element_size(), 4))
        else:
            G = tpg = 1
            rt = chunk // bn
            P = min(p_occ, max(n_v * rt, rt * n_d + n_v * n_d))  # (F_r has E_r's items)
            n_buf = (2 * _pad16(chunk * n_v) + 2 * _pad16(chunk) + _pad16(n_tiles)
                     + (_pad16(C) + _pad16(rt * n_v * bv) if has_bias else 0) + _cdiv(chunk * n_v * bv * h2.element_size(), 4))
        n_acc = 0
        stride_g = chunk  # the kernels' chunk argument
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
        hl.raw, hl.function, hl.packed, hl.coop, hl.pdl = direct_launcher(hl.compiled)
    return hl
