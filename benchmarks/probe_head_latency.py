"""Is a side head's cost to the graphed erase step its latency, or its work beside the forward?

    python benchmarks/probe_head_latency.py [--configs W:B:DTYPE,...] [--delays-us 2,4,8,16]
                                            [--holds SMS:US,...] [--captures K] [--out CSV]

At MLP w512 the fused heads cost the graphed erase step 23-43 us over zero-cost heads (`FreeHead`), at w256
nothing (session 23 NOTES). This probe puts pure latency in each head's place: a zero-cost head (replayed real
gradient) that first runs `torch.cuda._sleep` on its stream, one thread spinning for X us (no SM contention, no
bytes). If a delay near the fused head's own duration (6-15 us at 1/8 of the SMs) costs the step what fused
heads cost, the heads' cost is latency on the backward chains, and only removing the launch (fusing the head
into the producer GEMM's epilogue) would buy it back; if it costs much less, the cost is the heads' work beside
the forward. Variants, graphed erase, ReLU in the block: PyTorch heads, fused heads, zero-cost heads, and
zero-cost heads delayed by each X. Each variant is captured --captures times, alternating; a row is the median
over its captures of the median replay.
--holds SMS:US: zero-cost heads that first hold SMS SMs for US us each (a Triton spin of SMS programs of 1024
threads, no bytes moved: a cuBLAS GEMM CTA cannot share an SM with one), i.e. a head's SM-time without its
bytes. Holding as many SMs for as long as the fused head (16 SMs at 1/8) tells SM-time from bytes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata, print_table, write_csv  # noqa: E402

from erase_triton.study import FreeHead, _swap_heads, mlp_workload, time_step, with_heads  # noqa: E402

CONFIGS = [(512, 1024, "tf32"), (512, 4096, "tf32"), (512, 4096, "bf16"), (256, 1024, "tf32")]


class DelayedFreeHead(FreeHead):
    """A zero-cost head (replayed gradient) that spins one GPU thread for `cycles` clock cycles on its
    stream before back-propagating: a head's latency without its work."""

    cycles = 0

    def apply_loss(self, h, target, beside=False, act=None):
        if self.cycles > 0:
            torch.cuda._sleep(self.cycles)
        return super().apply_loss(h, target, beside, act)


@triton.jit
def _hold_sm(out_ptr, iters, BLOCK: tl.constexpr):
    """Each program spins a dependent FMA chain `iters` long on BLOCK lanes, then stores one value."""
    x = tl.arange(0, BLOCK).to(tl.float32) * 1e-3 + tl.program_id(0)
    for _ in range(iters):
        x = x * 0.9990234375 + 1.0
    tl.store(out_ptr + tl.program_id(0), tl.sum(x, 0))


def hold_sms(sms: int, iters: int, out: torch.Tensor):
    _hold_sm[(sms,)](out, iters, BLOCK=1024, num_warps=32)


def _per_us(launch, n: int) -> float:
    """launch(n)'s n a microsecond on this GPU now: one long launch timed by events, after a short
    one (compiles, wakes the clock)."""
    launch(n // 10)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    launch(n)
    e.record()
    torch.cuda.synchronize()
    return n / (s.elapsed_time(e) * 1e3)


def iters_per_us() -> float:
    """_hold_sm's loop iterations a microsecond (one program)."""
    out = torch.empty(1, device="cuda")
    return _per_us(lambda n: hold_sms(1, n, out), 200_000)


class HoldingFreeHead(FreeHead):
    """A zero-cost head (replayed gradient) that first holds `sms` SMs for `iters` spin iterations
    on its stream: a head's SM-time without its bytes."""

    sms = 0
    iters = 0

    def apply_loss(self, h, target, beside=False, act=None):
        if self.sms > 0:
            out = getattr(self, "_hold_out", None)
            if out is None or out.numel() < self.sms:
                out = self._hold_out = torch.empty(self.sms, device=h.device)
            hold_sms(self.sms, self.iters, out)
        return super().apply_loss(h, target, beside, act)


def cycles_per_us() -> float:
    """torch.cuda._sleep's clock cycles a microsecond."""
    return _per_us(torch.cuda._sleep, 20_000_000)


def variants(delays_us, holds, cycles_us: float, iters_us: float) -> list[tuple]:
    """(label, heads for `with_heads`, head class to swap in or None, its attributes, CSV columns) a variant."""
    out = [(v, v, None, {}, {}) for v in ("torch", "fused", "free-replayed")]
    out += [(f"delay{x:g}", "free-replayed", DelayedFreeHead, dict(cycles=int(round(x * cycles_us))), dict(delay_us=x))
            for x in delays_us]
    out += [(f"hold{n}:{x:g}", "free-replayed", HoldingFreeHead, dict(sms=n, iters=max(1, int(round(x * iters_us)))),
             dict(hold_sms=n, hold_us=x)) for n, x in holds]
    return out


def build(width, batch, dname, heads, cls=None, **attrs):
    """(model, inputs) of the MLP proxy with `heads`, each head then made a `cls` with attrs (if cls)."""
    dtype = {"tf32": torch.float32, "bf16": torch.bfloat16}[dname]
    model, inputs = with_heads(mlp_workload, heads, width, batch, dtype)
    if cls is not None:
        _swap_heads(model, cls, **attrs)
    return model, inputs


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(f"{w}:{b}:{d}" for w, b, d in CONFIGS),
                    help="MLP configs WIDTH:BATCH:tf32|bf16, comma-separated")
    ap.add_argument("--delays-us", default="2,4,8,16", help="comma-separated delays a head, microseconds (> 0)")
    ap.add_argument("--holds", default="16:6,16:12,132:1.5", help="SMS:US,...: heads that hold SMS SMs for US us "
                    "('' for none)")
    ap.add_argument("--captures", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/head_latency.csv")
    args = ap.parse_args(argv)
    try:
        args.configs = [(int(w), int(b), d) for w, b, d in (c.split(":") for c in args.configs.split(","))]
    except ValueError:
        ap.error(f"--configs takes WIDTH:BATCH:DTYPE,... (e.g. 512:1024:tf32), got {args.configs!r}")
    if any(d not in ("tf32", "bf16") for *_, d in args.configs):
        ap.error(f"--configs: the dtype of each config must be tf32 or bf16, got {args.configs!r}")
    try:
        args.delays_us = [float(x) for x in args.delays_us.split(",")]
    except ValueError:
        ap.error(f"--delays-us takes positive numbers, comma-separated, got {args.delays_us!r}")
    if any(x <= 0 for x in args.delays_us):
        ap.error(f"--delays-us takes positive numbers, comma-separated, got {args.delays_us!r}")
    try:
        args.holds = [(int(a), float(b)) for a, b in (x.split(":") for x in args.holds.split(",") if x)]
    except ValueError:
        ap.error(f"--holds takes SMS:US,... (e.g. 16:6,132:1.5), got {args.holds!r}")
    if any(a < 1 or b <= 0 for a, b in args.holds):
        ap.error(f"--holds takes SMS:US,... with SMS >= 1 and US > 0, got {args.holds!r}")
    if args.captures < 1:
        ap.error(f"--captures must be >= 1, got {args.captures}")
    return args


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_head_latency.py needs a CUDA device (it times captured steps)")
    torch.backends.cuda.matmul.allow_tf32 = True
    cpu = cycles_per_us()
    ipu = iters_per_us()
    print(f"torch.cuda._sleep: {cpu:.0f} cycles/us; _hold_sm: {ipu:.1f} iterations/us", flush=True)
    runs = variants(args.delays_us, args.holds, cpu, ipu)
    rows = []
    for w, b, d in args.configs:
        ms = {label: [] for label, *_ in runs}
        for _ in range(args.captures):
            for label, heads, cls, attrs, _cols in runs:
                model, inputs = build(w, b, d, heads, cls, **attrs)
                ms[label].append(time_step(model, inputs, "erase", True)["ms"])
                del model, inputs
        free, torch_ms, fused = (statistics.median(ms[v]) for v in ("free-replayed", "torch", "fused"))
        for label, *_, cols in runs:
            m = statistics.median(ms[label])
            rows.append(dict(width=w, batch=b, dtype=d, heads=label, **{"delay_us": "", "hold_sms": "", "hold_us": "",
                                                                         **cols},
                             ms=m, captures_ms=" ".join(f"{x:.4f}" for x in ms[label]), us_over_free=(m - free) * 1e3,
                             share_of_fused_cost=(m - free) / (fused - free) if fused > free else float("nan"),
                             torch_over=torch_ms / m, cycles_per_us=cpu, iters_per_us=ipu))
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    write_csv(args.out, rows, metadata())
    print_table(rows, ["width", "batch", "dtype", "heads", "ms", "us_over_free", "share_of_fused_cost", "torch_over"])


if __name__ == "__main__":
    main()
