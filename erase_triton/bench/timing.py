"""Timing of training steps: device events around graphed replays or eager steps, eager
schedules interleaved against host drift, peak memory, and the compiled e2e baseline."""
from __future__ import annotations

import contextlib
import ctypes
import random
import statistics
import time

import torch

from ..blocks import compile_blocks
from ..scheduler import Scheduler
from ..train import training_step
from .io import metadata
from .workloads import e2e_loss_fn

__all__ = ["copy_bandwidth_gbs", "host_us", "median_ms", "peak_mb", "step_runner", "tf32_metadata", "time_compiled_e2e", "time_eager_modes",
           "time_step"]


def median_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median per-call time: CUDA events around each call (host clock without CUDA)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def step_runner(sched, step_fn, inputs, graphed: bool):
    """run() doing one step: a replay of the captured step (capture() warms up), or the
    step issued eagerly inside sched.step() after three warm-up steps."""
    if graphed:
        return sched.capture(step_fn, *inputs, warmup=3)

    def run():
        with sched.step():
            step_fn(*inputs)
    for _ in range(3):
        run()
    return run


def time_step(model, inputs, mode: str, graphed: bool, streams=None, lr: float = 1e-3,
              priorities: bool | str | None = None, compiled: bool = False, early_update: bool = False,
              optimizer=None) -> dict:
    """Median step time (ms) of one mode; eager runs also report peak memory.
    priorities: Scheduler(priorities=...) of the erase ring; None: the Scheduler's default.
    compiled: torch.compile the blocks between the heads first (`compile_blocks`, Inductor).
    early_update: the scheduler steps the optimizer itself, each segment's parameters after its
    backward (Scheduler(optimizer=)); otherwise opt.step() after the step.
    optimizer: params -> torch.optim.Optimizer (default: SGD at lr)."""
    if compiled:
        compile_blocks(model)
    opt = optimizer(model.parameters()) if optimizer is not None else torch.optim.SGD(model.parameters(), lr=lr)
    kw = {} if priorities is None else dict(priorities=priorities)
    sched = Scheduler(mode, streams=streams, optimizer=opt if early_update else None, **kw)
    step = training_step(model, opt, step_optimizer=not early_update)

    out = {}
    run = step_runner(sched, step, inputs, graphed)
    if graphed:
        out["ms"] = median_ms(run, 30, 5)
        del run
    else:
        if torch.cuda.is_available():
            out["peak_mb"] = peak_mb(run)
        out["ms"] = median_ms(run, 20, 3)
    return out


_STREAMS: list = []  # the streams made for peak_mb, kept: one at a freed stream's address would find its caches


def new_stream() -> torch.cuda.ExternalStream:
    """A CUDA stream no one has used. torch.cuda.Stream() hands out one of a pool of 32 a device, so after 32
    calls it is one used before, whose per-stream caches (cuBLAS' workspaces, a fused head's scratch) exist."""
    handle = ctypes.c_void_p()
    err = ctypes.CDLL("libcuda.so.1").cuStreamCreate(ctypes.byref(handle), 1)  # CU_STREAM_NON_BLOCKING
    if err:
        raise RuntimeError(f"cuStreamCreate failed with CUresult {err}")
    _STREAMS.append(torch.cuda.ExternalStream(handle.value))
    return _STREAMS[-1]


def peak_mb(run, fresh_stream: bool = False, cublas_warm: bool = False) -> float:
    """Peak device memory (MB) that one call of run() allocates above what was live before it.
    fresh_stream: two calls on a new stream, so that the scratch a fused head keeps per stream
    (made by its first call there) counts, as a baseline's temporaries do. So does cuBLAS' workspace
    for that stream (32 MiB on an H100, per handle, made by the first GEMM there) unless cublas_warm:
    then a GEMM and a GEMM with a bias (cuBLASLt) run on the stream first, as a model's layers would."""
    torch.cuda.synchronize()
    with torch.cuda.stream(new_stream()) if fresh_stream else contextlib.nullcontext():
        if cublas_warm:
            a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
            torch.addmm(a[0], a, a), torch.mm(a, a)
            torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        if fresh_stream:
            run()
        torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def time_eager_modes(model, inputs, variants, iters: int = 40, lr: float = 1e-3, rounds: dict | None = None,
                     wall_steps: int = 0, wall: dict | None = None) -> dict:
    """Eager steps of several schedules, interleaved on one model (every round runs each
    variant once, in a shuffled order: A C B, B A C, ...).

    variants: {name: Scheduler}. An eager step is host-bound at small sizes, and the
    host's speed drifts over seconds, so modes timed one after another differ by more
    than the modes themselves; interleaving gives each the same drift, and shuffling
    each round removes a bias from the position in it. Returns
    {name: (median ms from CUDA events, peak MB of one step, median host ms to issue
    one step)}; host ms close to the event ms means the step is host-bound. rounds, if
    given, is filled with {name: [ms of each round]}, in round order: a ratio of two
    variants' times in the same round cancels drift slower than one round (a paired estimate).

    wall_steps=K > 0: after the event rounds, `iters` more rounds in which each variant runs K
    consecutive steps between two device syncs, timed by the host clock; `wall` is filled with
    {name: [ms a step of each round]}. That is a run's throughput: events time the GPU's share of a
    step, which in a host-bound step is not what a run of such steps takes (the host issues the
    next step no sooner). Each block starts on an idle GPU and ends with a drain, ~1/K of a lone
    step's extra time a step; that extra differs by variant (on an H200 at w2048: ~1.6 ms for
    sequential, ~0.35 ms for erase), so a small K leans slightly (~1% at K=10) towards erase.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    step = training_step(model, opt)
    runs = {name: step_runner(sched, step, inputs, False) for name, sched in variants.items()}
    cuda = torch.cuda.is_available()
    peak = {name: peak_mb(run) if cuda else float("nan") for name, run in runs.items()}
    ev = {name: [] for name in runs}
    host = {name: [] for name in runs}
    order, rng = list(runs), random.Random(0)
    for _ in range(iters):
        rng.shuffle(order)
        for name in order:
            run = runs[name]
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t = time.perf_counter()
            run()
            host[name].append((time.perf_counter() - t) * 1e3)
            if cuda:
                b.record()
                ev[name].append((a, b))
    if cuda:
        torch.cuda.synchronize()
        per_round = {name: [a.elapsed_time(b) for a, b in ev[name]] for name in runs}
    else:  # no device clock: the host's
        per_round = host
    ms = {name: statistics.median(per_round[name]) for name in runs}
    if rounds is not None:
        rounds.update(per_round)
    if wall_steps > 0:
        per_wall = {name: [] for name in runs}
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for _ in range(iters):
            rng.shuffle(order)
            for name in order:
                run = runs[name]
                sync()
                t = time.perf_counter()
                for _ in range(wall_steps):
                    run()
                sync()
                per_wall[name].append((time.perf_counter() - t) * 1e3 / wall_steps)
        if wall is not None:
            wall.update(per_wall)
    return {name: (ms[name], peak[name], statistics.median(host[name])) for name in runs}


def time_compiled_e2e(model, inputs, lr: float = 1e-3, graphed: bool = False) -> dict:
    """torch.compile of the plain e2e step (forward + loss compiled; backward via AOTAutograd).
    graphed: the whole step (compiled forward and backward, optimizer step) captured in one CUDA
    graph after the compiling warm-up steps, as graphed e2e is: the host then issues nothing."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = torch.compile(e2e_loss_fn(model))

    def step(*xs):
        opt.zero_grad(set_to_none=True)
        loss_fn(*xs).backward()
        opt.step()
    run = step_runner(Scheduler("e2e"), step, inputs, graphed)
    return {"ms": median_ms(run, 30, 5) if graphed else median_ms(run, 20, 5)}


def tf32_metadata() -> dict:
    """fp32 matmuls in TF32 (what a user on Hopper runs) for bench and sweep; recorded in the metadata."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    meta = metadata()
    meta["fp32_matmul"] = "tf32" if cuda else "ieee"
    return meta


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy bandwidth (bytes read + written), measured now."""
    import triton.testing

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3) / 1e9


def host_us(fn, n: int = 2000, warmup: int = 50) -> float:
    """Host time per call (µs) of fn issued back to back; the device is synchronised only
    around the loop, so with the GPU idle this is what the CPU spends issuing one call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6
