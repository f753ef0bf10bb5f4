"""What the vocabulary CE paths' chunking costs in accuracy: each output's relative L2 error against a float64
head, next to eager PyTorch's in the same precision.

    python benchmarks/bench_vocab_accuracy.py [--shape 4096:512:32000] [--paths cublas,cublas_vocab_chunks]
        [--chunks 448] [--out benchmarks/results/vocab_accuracy.csv]

A chunked path rounds more often than one GEMM does: `cublas` adds each chunk of rows into a 16-bit grad_W
(`addmm`, one rounding a chunk), `cublas_vocab_chunks` sums grad_h over its chunks of classes in fp32 and
rounds once. Rows: `torch` (eager PyTorch: bf16 Linear, cross_entropy, autograd), `one rounding` (the
reference in h's dtype: fp32 products and sums, each output rounded once: the best a 16-bit head returns),
each path by name at its own chunk rule, and `cublas` at --chunks rows. Columns: loss, grad_h, grad_W and
grad_b errors, and each over eager PyTorch's (`*_over_torch`). The same seed and inputs for every row.

Runs on a GPU, or on a CPU with the Triton kernels in the interpreter (TRITON_INTERPRET=1, set here when no
GPU is found, and made to round fp32 to bf16 to nearest even as the GPU does; 2-10 min a path at the default
shape on 2 cores): the roundings are the same (16-bit operands, fp32 accumulation, one rounding a GEMM
output), the order of the fp32 sums is not.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096:512:32000", help="N:D:V")
    ap.add_argument("--paths", default="cublas,cublas_vocab_chunks", help="vocabulary paths, each at its chunk rule")
    ap.add_argument("--chunks", default="448", help="chunk sizes (rows) of vocab_path='cublas' besides its rule's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/vocab_accuracy.csv")
    args = ap.parse_args()
    try:
        N, D, C = (int(x) for x in args.shape.split(":"))
        chunks = [int(x) for x in args.chunks.split(",") if x]
        assert min(N, D, C, *chunks) > 0 and C > 512
    except (ValueError, AssertionError):
        ap.error(f"--shape N:D:V (V > 512, a vocabulary head) and --chunks A,B,...: expected positive integers, "
                 f"got {args.shape!r} and {args.chunks!r}")
    return args, (N, D, C), chunks


def main():
    args, (N, D, C), chunks = parse()
    import torch

    if not torch.cuda.is_available():  # before any kernel module is imported
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.nn.functional as F

    from erase_triton import LaunchConfig, fused_local_head, reference
    from erase_triton.bench import metadata, print_table, round_bf16_like_the_gpu, write_csv
    from erase_triton.kernels.launch import VOCAB_PATHS
    from erase_triton.reference import head_loss

    paths = [p for p in args.paths.split(",") if p]
    if any(p not in VOCAB_PATHS for p in paths):
        sys.exit(f"--paths: expected some of {', '.join(VOCAB_PATHS)}, got {args.paths!r}")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        round_bf16_like_the_gpu()  # (the interpreter truncates to bf16: a -0.3% bias on every bf16 output)
    g = torch.Generator().manual_seed(args.seed)
    h = torch.randn(N, D, generator=g).bfloat16().to(dev)
    w = (torch.randn(C, D, generator=g) / D ** 0.5).bfloat16().to(dev)
    b = (torch.randn(C, generator=g) * 0.1).bfloat16().to(dev)
    y = torch.randint(0, C, (N,), generator=g).to(dev)
    ref = reference.local_head(h.double(), w.double(), b.double(), y, loss="ce")

    def eager():
        hh, ww, bb = (t.detach().requires_grad_(True) for t in (h, w, b))
        loss = head_loss(F.linear(hh, ww, bb), y, "ce", "mean", -100)
        return (loss.detach(), *torch.autograd.grad(loss, [hh, ww, bb]))

    def ours(cfg):
        r = fused_local_head(h, w, b, y, loss="ce", config=cfg, backend="triton")
        return r.loss, r.grad_h, r.grad_weight, r.grad_bias

    variants = [("torch", eager), ("one rounding", lambda: tuple(reference.local_head(h, w, b, y, loss="ce")))]
    variants += [(p, lambda p=p: ours(LaunchConfig(vocab_path=p))) for p in paths]
    variants += [(f"cublas chunk_size={cs}", lambda cs=cs: ours(LaunchConfig(vocab_path="cublas", chunk_size=cs)))
                 for cs in chunks]
    names = ("loss", "grad_h", "grad_W", "grad_b")
    rows = []
    for name, fn in variants:
        t = time.perf_counter()
        out = fn()
        row = dict(N=N, D=D, C=C, variant=name, seconds=round(time.perf_counter() - t, 1))
        for what, o, r in zip(names, out, (ref.loss, ref.grad_h, ref.grad_weight, ref.grad_bias)):
            o, r = o.double().cpu(), r.double().cpu()
            row[what] = ((o - r).norm() / r.norm()).item()
        rows.append(row)
        print({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    for row in rows:
        for what in names:
            row[f"{what}_over_torch"] = row[what] / rows[0][what] if rows[0][what] > 0 else float("nan")
    meta = metadata()
    meta["kernels"] = "compiled" if dev == "cuda" else "Triton interpreter"
    write_csv(args.out, rows, meta)
    print_table(rows, ["variant", *names, "grad_h_over_torch", "grad_W_over_torch", "grad_b_over_torch"])


if __name__ == "__main__":
    main()
