"""Is every GPU step clean and does a long run stay flat? The GPU side of the reliability checks.

    compute-sanitizer --tool memcheck  python3 benchmarks/check_reliability.py steps   # also racecheck, synccheck
    compute-sanitizer --tool synccheck python3 benchmarks/check_reliability.py steps --no-cudnn-sdpa
    compute-sanitizer --tool memcheck  python3 benchmarks/check_reliability.py heads [--paths cublas ...]
    python3 benchmarks/check_reliability.py soak --steps 2000 --out DIR/soak.csv
    compute-sanitizer --tool racecheck python3 benchmarks/check_reliability.py ws_switch [--barrier]

steps: one eager and one captured erase step (adaptive=False: every detach point forks) of the CTR
proxy and of the transformer, at small sizes (the sanitizer slows kernels 10-100x).
heads: every head kernel (dense BCE/MSE, small-vocabulary CE in both grad_h forms, every vocabulary CE path;
deterministic and atomic) at a few shapes, at occupancy 1/32 (one program can hold most of the work), 1/8 and 1.
ws_switch: whose are the racecheck reports in cublas_vocab_chunks' Gluon pass (lse_gemm_kernel)? A
warp-specialized Gluon kernel with no shared memory of its own: three partitions, each writing its own words of
a global buffer, launched as that pass is ([4, 1] worker warps, its registers). Racecheck reports the same
hazard as there (a worker's read of Triton's partition-state byte against the default partition's write of it,
which full-CTA barriers order) when the default partition holds a barrier of its own warps (--barrier:
`gl.thread_barrier()`, bar.sync 0, 128; the pass's SASS has 18 such), and none without it.
soak: the CTR proxy trained with graphed and with eager erase for --steps steps; device memory
(allocated and reserved) and the loss every 100 steps; the summary row says whether memory after
the last step is within 1% of memory after step 100 and every loss is finite.
Run by `bash benchmarks/run_gpu_checks.sh DIR sanitizer soak`.
"""
from __future__ import annotations

import argparse
import math

import torch

from erase_triton import LaunchConfig, Scheduler, fused_local_head
from erase_triton.kernels.launch import CUBLAS_PATHS, VOCAB_PATHS
from erase_triton.bench import ctr_workload, metadata, print_table, transformer_workload, write_csv
from erase_triton.train import training_step

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover
    gluon = None


def steps(models=("ctr", "transformer"), execs=("eager", "captured")):
    builds = {"ctr": lambda: ctr_workload(256, 1024, rows=10_000), "transformer": lambda: transformer_workload(128, 4, 64)}
    for name in models:
        build = builds[name]
        for captured in [e == "captured" for e in execs]:
            model, inputs = build()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            sched = Scheduler("erase", adaptive=False)
            step = training_step(model, opt)
            if captured:
                sched.capture(step, *inputs, warmup=2)()
            else:
                with sched.step():
                    step(*inputs)
            torch.cuda.synchronize()
            print(f"{name} {'captured' if captured else 'eager'} erase step: forks={sched.last_forks}", flush=True)


def heads(paths=None):
    dev = "cuda"
    # ("ce", 256, 128, 256): the transformer's heads in `steps` (16-bit, C <= 256: the GH_T form);
    # ("bce", 1024, 256, 1, fp32): the CTR proxy's heads there (fp32: the C = 1 kernel without a dot)
    bf16 = torch.bfloat16
    cases = [("bce", 1000, 512, 1, None, bf16), ("bce", 1024, 256, 1, None, torch.float32), ("mse", 333, 130, 17, None, bf16),
             ("ce", 777, 64, 40, None, bf16), ("ce", 1000, 256, 300, None, bf16), ("ce", 256, 128, 256, None, bf16),
             ("ce", 513, 128, 5000, "recompute", bf16), ("ce", 513, 128, 5000, "vocab_chunks", bf16),
             ("ce", 513, 128, 5000, "row_chunks", bf16), ("ce", 513, 128, 5000, "cublas", bf16),
             ("ce", 513, 128, 5000, "cublas_vocab_chunks", bf16),
             ("ce", 200, 256, 5000, "cublas_in_place", bf16)]  # (at most D rows: the logits in grad_W's memory)
    for loss, N, D, C, path, dt in cases:
        if paths is not None and (path or "small") not in paths:
            continue
        for occ in (1 / 32, 1 / 8, None):
            for det in (True, False):
                g = torch.Generator(device="cpu").manual_seed(0)
                h = torch.randn(N, D, generator=g).to(dev, dt)
                w = (torch.randn(C, D, generator=g) / D ** 0.5).to(dev, dt)
                b = torch.randn(C, generator=g).to(dev, dt)
                y = (torch.randint(0, C, (N,), generator=g) if loss == "ce" else torch.rand(N, C, generator=g)).to(dev)
                cfg = LaunchConfig(occupancy=occ, deterministic=det, vocab_path=path, chunk_size=256 if path else None)
                # the cublas paths: also without a bias ("cublas": its other softmax form, the row held, read once)
                for bias in (b, None) if path in CUBLAS_PATHS else (b,):
                    r = fused_local_head(h, w, bias, y, loss=loss, config=cfg)
                    torch.cuda.synchronize()
                    ok = all(torch.isfinite(t).all().item() for t in r if t is not None)
                    print(f"{loss} N={N} D={D} C={C} {str(dt)[6:]} {path or ''} occupancy={occ} deterministic={det}"
                          f"{'' if bias is not None else ' bias=None'}: finite={ok}", flush=True)


def soak(n_steps: int, out: str):
    rows = []
    for graphed in (True, False):
        model, inputs = ctr_workload(1024, 4096)
        head = model.final_head
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        sched = Scheduler("erase")
        step = training_step(model, opt)
        if graphed:
            run = sched.capture(step, *inputs, warmup=3)
        else:
            def run(sched=sched, step=step, inputs=inputs):
                with sched.step():
                    step(*inputs)
        for i in range(1, n_steps + 1):
            run()
            if i % 100 == 0:
                torch.cuda.synchronize()
                rows.append(dict(exec="graph" if graphed else "eager", step=i, loss=head.last_loss.item(),
                                 allocated_mb=torch.cuda.memory_allocated() / 2 ** 20,
                                 reserved_mb=torch.cuda.memory_reserved() / 2 ** 20))
        del run, model, inputs, opt, sched
        torch.cuda.empty_cache()
    summary = []
    for ex in ("graph", "eager"):
        r = [x for x in rows if x["exec"] == ex]
        if not r:
            continue
        summary.append(dict(exec=ex, step="summary", loss=r[-1]["loss"], allocated_mb=r[-1]["allocated_mb"],
                            reserved_mb=r[-1]["reserved_mb"],
                            memory_flat=abs(r[-1]["allocated_mb"] - r[0]["allocated_mb"]) <= 0.01 * r[0]["allocated_mb"],
                            loss_finite=all(math.isfinite(x["loss"]) for x in r)))
    write_csv(out, rows + summary, metadata())
    print_table(summary, ["exec", "step", "loss", "allocated_mb", "reserved_mb", "memory_flat", "loss_finite"])


if gluon is not None:
    from erase_triton.kernels import vocab_ce_lse_gemm as _lse_gemm
    _WS_REGS = gl.constexpr([_lse_gemm.CONSUMER_REGS, _lse_gemm.LOADER_REGS])  # (the pass's, as it launches)

    @gluon.jit
    def _ws_part(out_ptr, k: gl.constexpr, warps: gl.constexpr):
        i = gl.arange(0, 32 * warps, layout=gl.BlockedLayout([1], [32], [warps], [0]))
        gl.store(out_ptr + gl.program_id(0) * 1024 + k * 256 + i, i.to(gl.float32) + k)

    @gluon.jit
    def _ws_default(out_ptr, BARRIER: gl.constexpr):
        _ws_part(out_ptr, 0, 4)
        if BARRIER:
            gl.thread_barrier()
        _ws_part(out_ptr, 3, 4)

    @gluon.jit
    def _ws_worker(out_ptr):
        _ws_part(out_ptr, 1, 4)

    @gluon.jit
    def _ws_loader(out_ptr):
        _ws_part(out_ptr, 2, 1)

    @gluon.jit
    def ws_switch_kernel(out_ptr, BARRIER: gl.constexpr, num_warps: gl.constexpr):
        gl.warp_specialize([(_ws_default, (out_ptr, BARRIER)), (_ws_worker, (out_ptr,)), (_ws_loader, (out_ptr,))],
                           [4, 1], _WS_REGS)


def ws_switch(barrier: bool):
    programs = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    out = torch.full((programs, 4, 256), -1.0, device="cuda")
    ws_switch_kernel[(programs,)](out, BARRIER=barrier, num_warps=_lse_gemm.WARPS)
    want = torch.arange(256, dtype=torch.float32, device="cuda")[None, :] + torch.arange(4, device="cuda")[:, None]
    want[:, 128:] = -1.0  # (a partition of 4 warps writes 128 words, the loader's one warp 32)
    want[2, 32:] = -1.0
    ok = bool((out == want).all())
    print(f"ws_switch barrier={barrier}: programs={programs} outputs {'as written' if ok else 'WRONG'}", flush=True)
    if not ok:
        raise SystemExit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["steps", "heads", "soak", "ws_switch"])
    ap.add_argument("--steps", type=int, default=2000, help="soak: steps per run (a multiple of 100)")
    ap.add_argument("--out", default="soak.csv", help="soak: the CSV")
    ap.add_argument("--models", nargs="+", choices=["ctr", "transformer"], default=["ctr", "transformer"],
                    help="steps: which models (to find which step a sanitizer report comes from)")
    ap.add_argument("--execs", nargs="+", choices=["eager", "captured"], default=["eager", "captured"], help="steps: which")
    ap.add_argument("--paths", nargs="+", choices=["small", *VOCAB_PATHS],
                    help="heads: only these kernels (small: the dense and small-vocabulary heads); default all")
    ap.add_argument("--no-cudnn-sdpa", action="store_true",
                    help="steps: keep PyTorch's attention off cuDNN (synccheck flags cuDNN's flash backward kernel)")
    ap.add_argument("--barrier", action="store_true", help="ws_switch: a barrier of the default partition's warps")
    a = ap.parse_args()
    if a.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if a.steps < 100 or a.steps % 100:
        raise SystemExit(f"--steps: expected a positive multiple of 100, got {a.steps}")
    if not torch.cuda.is_available():
        raise SystemExit("check_reliability.py needs a CUDA device")
    if a.what == "steps":
        steps(a.models, a.execs)
    elif a.what == "heads":
        heads(a.paths)
    elif a.what == "ws_switch":
        if gluon is None or torch.cuda.get_device_capability()[0] < 9:
            raise SystemExit("ws_switch needs Gluon and a Hopper or newer GPU")
        ws_switch(a.barrier)
    else:
        soak(a.steps, a.out)


if __name__ == "__main__":
    main()
