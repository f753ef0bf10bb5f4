"""Execution traces of erase steps: Chrome traces, per-kernel intervals and timeline plots
(`erase-triton trace`). Needs CUDA (the kernel timeline comes from CUPTI)."""
from __future__ import annotations

import json
import os

import torch

from ..blocks import compile_blocks
from ..kernels.plan import KERNELS
from ..scheduler import Scheduler
from .heads import with_heads
from .io import write_csv
from .plots import plot_timeline
from ..progress import say
from .timing import step_runner, tf32_metadata
from .workloads import mlp_workload, transformer_workload

__all__ = ["kernel_intervals", "trace"]

_HEAD_KERNELS = tuple(k.fn.__name__ for k in KERNELS.values())


def kernel_intervals(prof, graphed: bool = False) -> list[dict]:
    """(stream, start, end, name, phase) of every kernel; the phase comes from the
    erase::* range (on the host) that was open when the kernel was launched. A graph
    replay launches every kernel at once, so there only head kernels are told apart."""
    evs = list(prof.profiler.kineto_results.events())
    ranges, launches, kernels = [], {}, []
    for e in evs:
        name = e.name()
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            kernels.append(e)
        elif name.startswith("erase::"):
            ranges.append((e.start_ns(), e.start_ns() + e.duration_ns(), name.split("::")[1].split(" ")[0]))
        elif "LaunchKernel" in name or "cudaGraphLaunch" in name or "cuLaunch" in name:
            launches[e.correlation_id()] = e.start_ns()
    out = []
    for k in kernels:
        t = launches.get(k.correlation_id())
        phase = "fwd/bwd (graph)" if graphed else "forward"
        if any(n in k.name() for n in _HEAD_KERNELS):
            phase = "head"
        elif t is not None and not graphed:
            inner = [r for r in ranges if r[0] <= t <= r[1]]
            if inner:
                phase = min(inner, key=lambda r: r[1] - r[0])[2]
        out.append(dict(stream=k.device_resource_id(), start=k.start_ns(), end=k.start_ns() + k.duration_ns(),
                        name=k.name(), phase=phase))
    t0 = min((k["start"] for k in out), default=0)
    for k in out:
        k["start"] = (k["start"] - t0) / 1e3
        k["end"] = (k["end"] - t0) / 1e3
    return out


def trace(out_dir: str, steps: int = 3, log=say, execs=("graph", "eager"), only: str | None = None) -> list[dict]:
    """Chrome traces + timeline PNGs of erase steps, replayed from a CUDA graph and issued
    eagerly: the small transformer (overlap), a saturating MLP (nothing to overlap), and the
    w512 b4096 MLP with fused and with PyTorch heads (bf16, tf32) and with zero-cost heads (tf32;
    tf32 dots on), and the tf32 one with the blocks' last ReLU in the heads ("_relu_in_head"); the
    w512 b1024 tf32 MLP (ReLU in the heads) and the transformer w512 b32 s256 with fused, PyTorch and
    zero-cost heads, and with its blocks compiled (`compile_blocks`).
    only: keep the configs whose name contains it. Returns per-config overlap summaries."""
    if not torch.cuda.is_available():
        raise RuntimeError("trace needs a CUDA device (kernel timelines come from CUPTI)")
    meta = tf32_metadata()  # the tf32 configs (fp32 weights) as bench_schedule runs them
    os.makedirs(out_dir, exist_ok=True)
    configs = [("transformer_w256_b32_s128", lambda: transformer_workload(256, 32, 128)),
               ("transformer_w1024_b32_s256", lambda: transformer_workload(1024, 32, 256)),
               ("mlp_w4096_b32768_saturating", lambda: mlp_workload(4096, 32768))]
    # the sizes where the fused heads gain least (bench_schedule, graphed): fused, PyTorch and zero-cost heads
    for dname, heads, relu in (("bf16", "fused", False), ("bf16", "torch", False), ("tf32", "fused", False),
                               ("tf32", "torch", False), ("tf32", "free", False), ("tf32", "fused", True),
                               ("tf32", "torch", True)):
        configs.append((f"mlp_w512_b4096_{dname}_{heads}_heads" + ("_relu_in_head" if relu else ""),
                        lambda dname=dname, heads=heads, relu=relu: with_heads(
                            mlp_workload, heads, 512, 4096, torch.bfloat16 if dname == "bf16" else torch.float32,
                            relu_in_head=relu)))
    # fused, PyTorch and zero-cost heads: the w512 b1024 tf32 MLP with the ReLU in the heads (latency-bound, fused
    # heads 1.11x PyTorch heads, bound 1.16) and the transformer w512 b32 s256
    for name, workload, args, kw in (("mlp_w512_b1024_tf32_{}_heads_relu_in_head", mlp_workload,
                                      (512, 1024, torch.float32), dict(relu_in_head=True)),
                                     ("transformer_w512_b32_s256_{}_heads", transformer_workload, (512, 32, 256), {})):
        for heads in ("fused", "torch", "free"):
            configs.append((name.format(heads), lambda w=workload, h=heads, a=args, k=kw: with_heads(w, h, *a, **k)))
    # the transformer with its blocks compiled (compile_blocks): Inductor's kernels on the segments' streams
    configs.append(("transformer_w512_b32_s256_compiled_blocks",
                    lambda: compiled_blocks(*transformer_workload(512, 32, 256))))
    configs = [c for c in configs if only is None or only in c[0]]
    summary = []
    for (cfg, build), ex in [(c, e) for c in configs for e in execs]:
        name = f"{cfg}_{ex}"
        model, inputs = build()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        sched = Scheduler("erase")

        def step_fn(*xs, model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            model(*xs)
            with torch.profiler.record_function("erase::optimizer"):
                opt.step()
        run = step_runner(sched, step_fn, inputs, ex == "graph")
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run()
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(out_dir, f"trace_{name}.json"))
        ks = kernel_intervals(prof, graphed=ex == "graph")
        busy = _union([(k["start"], k["end"]) for k in ks])
        total = sum(k["end"] - k["start"] for k in ks)
        s = dict(config=cfg, exec=ex, kernels=len(ks), streams=len({k["stream"] for k in ks}), span_us=max(k["end"] for k in ks),
                 busy_us=busy, kernel_sum_us=total, concurrency=total / max(busy, 1e-9))
        summary.append(s)
        log(s)
        plot_timeline(ks, os.path.join(out_dir, f"timeline_{name}.png"), title=f"{cfg}: {steps} {ex} erase steps "
                      f"(kernel time / busy time = {s['concurrency']:.2f})")
        with open(os.path.join(out_dir, f"kernels_{name}.json"), "w") as f:
            json.dump(ks, f)
        del run, model, inputs, opt, sched, prof
        torch.cuda.empty_cache()
    write_csv(os.path.join(out_dir, "trace_summary.csv"), summary, meta)
    return summary


def compiled_blocks(model, inputs):
    compile_blocks(model)
    return model, inputs


def _union(iv):
    tot, end = 0.0, float("-inf")
    for s, e in sorted(iv):
        if s > end:
            tot += e - s
            end = e
        elif e > end:
            tot += e - end
            end = e
    return tot
