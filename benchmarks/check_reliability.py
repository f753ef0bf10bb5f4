"""Is every GPU step clean and does a long run stay flat? The GPU side of the reliability checks.

    compute-sanitizer --tool memcheck  python3 benchmarks/check_reliability.py steps   # also racecheck, synccheck
    compute-sanitizer --tool synccheck python3 benchmarks/check_reliability.py steps --no-cudnn-sdpa
    compute-sanitizer --tool memcheck  python3 benchmarks/check_reliability.py heads [--paths cublas ...]
    python3 benchmarks/check_reliability.py soak --steps 2000 --out DIR/soak.csv

steps: one eager and one captured erase step (adaptive=False: every detach point forks) of the CTR
proxy and of the transformer, at small sizes (the sanitizer slows kernels 10-100x).
heads: every head kernel (dense BCE/MSE, small-vocabulary CE in both grad_h forms, every vocabulary CE path;
deterministic and atomic) at a few shapes, at occupancy 1/32 (one program can hold most of the work), 1/8 and 1.
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
             ("ce", 513, 128, 5000, "cublas_vocab_chunks", bf16)]
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["steps", "heads", "soak"])
    ap.add_argument("--steps", type=int, default=2000, help="soak: steps per run (a multiple of 100)")
    ap.add_argument("--out", default="soak.csv", help="soak: the CSV")
    ap.add_argument("--models", nargs="+", choices=["ctr", "transformer"], default=["ctr", "transformer"],
                    help="steps: which models (to find which step a sanitizer report comes from)")
    ap.add_argument("--execs", nargs="+", choices=["eager", "captured"], default=["eager", "captured"], help="steps: which")
    ap.add_argument("--paths", nargs="+", choices=["small", *VOCAB_PATHS],
                    help="heads: only these kernels (small: the dense and small-vocabulary heads); default all")
    ap.add_argument("--no-cudnn-sdpa", action="store_true",
                    help="steps: keep PyTorch's attention off cuDNN (synccheck flags cuDNN's flash backward kernel)")
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
    else:
        soak(a.steps, a.out)


if __name__ == "__main__":
    main()
