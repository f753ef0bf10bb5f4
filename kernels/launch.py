"""Launch settings for the fused local-head kernels.

`LaunchConfig` is a frozen value passed to every launch, so the occupancy sweep,
the tests and the library all run the same code path. Nothing here touches CUDA
at import: device properties are read lazily and cached.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton

__all__ = ["LaunchConfig", "check_occupancy", "device_limits", "interpreting", "num_programs"]

_FP32_PRECISIONS = ("ieee", "tf32")
CUBLAS_PATHS = ("cublas", "cublas_vocab_chunks", "cublas_in_place")  # cuBLAS GEMMs around Triton kernels
VOCAB_PATHS = ("recompute", "vocab_chunks", "row_chunks") + CUBLAS_PATHS


def check_occupancy(occupancy, allow_auto: bool = False):
    """None, a number in (0, 1] (not a bool), or "auto" where allowed; ValueError otherwise."""
    if occupancy is None or (allow_auto and isinstance(occupancy, str) and occupancy == "auto"):
        return
    if isinstance(occupancy, bool) or not isinstance(occupancy, (int, float)) or not 0 < occupancy <= 1:
        want = "a number in (0, 1], None or 'auto'" if allow_auto else "a number in (0, 1] or None"
        raise ValueError(f"occupancy must be {want}, got {occupancy!r}")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How a fused head is launched.

    occupancy:      fraction of the SMs the persistent grid may fill (0 < x <= 1);
                    None fills the whole device.
    programs_per_sm: at most this many programs per SM in the grid-size rule (None: as many
                    as the kernel's registers and shared memory allow). With 1 or 2, a head
                    beside another stream's GEMMs leaves room for a GEMM CTA on each SM it
                    uses, instead of filling whole SMs (spread it with a larger occupancy).
                    No faster than the default on the H200 (docs/tuning.md#side-head-occupancy).
    max_registers:  ptxas' cap on registers per thread (the `maxnreg` compile option; CUDA only);
                    None: the kernel's default rule. Fewer registers fit more programs on an SM.
    two_pass:       (dense kernel, C = 1, atomic mode) each program reads its row tiles twice:
                    logits, loss and dz first (h reduced as it arrives, dz kept in an N-float
                    workspace), then grad_h and grad_W (h again, from L2). No tile is held across
                    the row reduction: fewer registers, loads that pipeline. (vocab_path="cublas")
                    True: each row of logits is read twice, in blocks of block_v columns (default
                    4096: its lse, then dz), where a head without a bias of at most 32768 classes
                    would hold it and read it once; False: held, a ValueError where that cannot be
                    (a bias: its column sums; more classes). None: the host rule.
    block_n/block_d/block_v/num_warps: tile sizes; None picks the host rule. block_n may
                    be below 16 only for the dense kernel with C == 1 (no tl.dot). The cublas paths
                    take block_v only, as their lse kernel's columns a load.
    num_stages:     software-pipelining depth: of the row-tile loop (dense kernel), of every K loop
                    (vocabulary kernels: Triton's `num_stages` compile option; None: Triton's default).
    group_tiles:    row tiles per grad_W partial group, claimed by the programs (dense kernel).
                    None: deterministic launches spread the tiles evenly, one group a program;
                    atomic ones split them statically (program p takes tiles p, p + P, ...).
                    Smaller groups balance the programs' finishing times; deterministic, each
                    adds a partial row to the fixed-order reduction.
    fp32_precision: dots on fp32 inputs: "ieee" (exact) or "tf32"; None follows
                    torch.backends.cuda.matmul.allow_tf32 at call time, like a Linear.
    vocab_path:     the vocabulary CE kernel (C > 512). None: "cublas" on CUDA for bf16 h, weight and bias
                    at full occupancy with no Triton tile field set ("cublas_in_place" where it runs: N <= D,
                    no existing .grad, no chunk_size), else "vocab_chunks" below D = 2048, "row_chunks"
                    from there (`kernels.plan.vocab_path_for`).
                    "recompute" (vocab_ce.py): nothing of size N x C in memory; the logits are
                    recomputed once per D chunk of grad_h and of grad_W.
                    "vocab_chunks" (vocab_ce_vocab_chunks.py): four GEMM passes; dz goes through an
                    [N, chunk_size] scratch in h's dtype (and grad_h through an fp32 [N, D] one
                    between chunks).
                    "row_chunks" (vocab_ce_row_chunks.py): three GEMM passes; softmax numerators, then
                    dz, go through a [chunk_size, C] scratch in h's dtype, and grad_W is summed over the
                    row chunks in its own dtype (one chunk: no extra rounding).
                    "cublas" (vocab_ce_cublas.py): the three GEMMs by cuBLAS and two Triton kernels
                    (the rows' lse; dz and grad_b's column sums) a chunk of rows, through an
                    [chunk_size, C] scratch of logits in h's dtype (rounded there, as eager PyTorch
                    rounds them); several launches, no host
                    sync; bf16 or fp32 inputs with weight and bias in h's dtype; the whole device
                    whatever the occupancy (cuBLAS picks its grid).
                    "cublas_vocab_chunks" (vocab_ce_cublas_vocab_chunks.py): as "cublas", in chunks of
                    classes over every row: an [N, chunk_size] scratch, four GEMMs (the logits twice),
                    grad_W and grad_b written once and grad_h summed in fp32. Its scratch can be any
                    size: the lean choice for a narrow h (small D), where "cublas" needs at least 1024 x C.
                    "cublas_in_place" (vocab_ce_cublas_in_place.py): as "cublas" over every row at once,
                    the logits (transposed) in grad_W's own memory until grad_W is written over them, block
                    of classes by block: three GEMMs, grad_W written once, a [chunk_size, N] scratch and an
                    fp32 grad_h. Takes N <= D (the logits fit in grad_W) and a grad_W it writes
                    (accumulate=False: no existing .grad).
                    Measurements and the choice between them: docs/tuning.md#vocabulary-ce-paths.
    chunk_size:     vocabulary columns ("vocab_chunks", "cublas_vocab_chunks") or rows ("row_chunks",
                    "cublas") a chunk, rounded up to the kernel's tile. None: the host rule, a scratch of
                    at most max(16 MiB, a quarter of grad_W's bytes), except that "row_chunks" takes at
                    least enough rows to give every program a grad_h tile, "cublas" at least
                    1024 rows, up to 3/8 of grad_W's bytes, the last chunk the rest, and
                    "cublas_vocab_chunks" classes in 128s up to 7/8 of grad_W's bytes, evened out over
                    the chunks (`kernels.plan.chunk_size_for`). "cublas_in_place": classes a block (the scratch's
                    rows), None: 2048.
    deterministic:  True: grad_weight, grad_bias and the loss are summed in a fixed order
                    after a grid barrier, so results are bitwise reproducible. False permits
                    float atomics instead (no barrier, no reduction phase) where the weight
                    fits one tile (dense kernel, C * next_pow2(D) <= 8192: BCE/MSE heads and
                    CE with few classes); their last bits then depend on program timing, and
                    other heads stay deterministic. None (default) follows
                    torch.are_deterministic_algorithms_enabled() at call time, like PyTorch's
                    own atomic kernels (docs/tuning.md#atomic-or-deterministic-sums).
    """

    occupancy: float | None = None
    block_n: int | None = None
    block_d: int | None = None
    block_v: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    fp32_precision: str | None = None
    group_tiles: int | None = None
    deterministic: bool | None = None
    programs_per_sm: int | None = None  # last fields: positional construction keeps its old meaning
    max_registers: int | None = None
    two_pass: bool | None = None
    vocab_path: str | None = None
    chunk_size: int | None = None

    def __post_init__(self):
        check_occupancy(self.occupancy)
        if self.fp32_precision is not None and self.fp32_precision not in _FP32_PRECISIONS:
            raise ValueError(f"fp32_precision must be one of {_FP32_PRECISIONS}, got {self.fp32_precision!r}")
        for name, least in (("block_n", 1), ("block_d", 16), ("block_v", 16)):
            v = getattr(self, name)
            if v is not None and (v < least or v & (v - 1)):
                raise ValueError(f"{name} must be a power of two >= {least}, got {v!r}")
        if self.group_tiles is not None and (not isinstance(self.group_tiles, int) or self.group_tiles < 1):
            raise ValueError(f"group_tiles must be a positive int or None, got {self.group_tiles!r}")
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be a bool or None, got {self.deterministic!r}")
        if self.programs_per_sm is not None and (not isinstance(self.programs_per_sm, int) or self.programs_per_sm < 1):
            raise ValueError(f"programs_per_sm must be a positive int or None, got {self.programs_per_sm!r}")
        if self.max_registers is not None and (not isinstance(self.max_registers, int)
                                               or not 24 <= self.max_registers <= 255):
            raise ValueError(f"max_registers must be an int in [24, 255] or None, got {self.max_registers!r}")
        if self.two_pass is not None and not isinstance(self.two_pass, bool):
            raise ValueError(f"two_pass must be a bool or None, got {self.two_pass!r}")
        if self.vocab_path is not None and self.vocab_path not in VOCAB_PATHS:
            raise ValueError(f"vocab_path must be one of {VOCAB_PATHS} or None, got {self.vocab_path!r}")
        if self.chunk_size is not None and (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
                                            or self.chunk_size < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {self.chunk_size!r}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def device_limits(index: int) -> tuple[int, int, int]:
    """(SM count, registers per SM, shared memory per SM in bytes) of a CUDA device."""
    props = torch.cuda.get_device_properties(index)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    return props.multi_processor_count, regs, smem


# Programs per SM for a compiled kernel, keyed by (kernel name, constexpr key, device).
_PER_SM: dict = {}


def _programs_per_sm(compiled, num_warps: int, regs_per_sm: int, smem_per_sm: int) -> int:
    # Same rule as Triton's fused-softmax tutorial: registers and shared memory
    # of the compiled kernel against the SM's limits.
    n_regs = max(int(getattr(compiled, "n_regs", 0) or 0), 1)
    by_regs = regs_per_sm // (n_regs * 32 * num_warps)
    shared = int(compiled.metadata.shared) if hasattr(compiled, "metadata") else 0
    by_smem = smem_per_sm // shared if shared > 0 else by_regs
    return max(1, min(by_regs, by_smem, 2048 // (32 * num_warps)))


def num_programs(kernel, key, warmup, device: torch.device, num_warps: int, occupancy: float | None,
                 programs_per_sm: int | None = None) -> int:
    """Persistent grid size: occupancy x SMs, times how many programs fit on one SM (at most
    programs_per_sm).

    `warmup()` compiles the kernel (only called once per key) and returns the
    compiled object. Under the interpreter there is no device: 4 pretend SMs.
    """
    frac = 1.0 if occupancy is None else float(occupancy)
    if device.type != "cuda":
        return max(1, round(frac * 4))
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms, regs, smem = device_limits(index)
    ck = (kernel, key, index)
    per_sm = _PER_SM.get(ck)
    if per_sm is None:
        compiled = warmup()
        if hasattr(compiled, "_init_handles"):
            compiled._init_handles()
        per_sm = _PER_SM[ck] = _programs_per_sm(compiled, num_warps, regs, smem)
    return max(1, round(frac * sms)) * min(per_sm, programs_per_sm or per_sm)


def next_pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))
