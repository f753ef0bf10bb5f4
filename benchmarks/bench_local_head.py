"""Fused local head vs torch eager, torch.compile, Liger and Cut Cross-Entropy (ce): time,
bandwidth, memory, achieved TFLOP/s.

    python benchmarks/bench_local_head.py [--out DIR/local_head.csv] [--quick]
    python benchmarks/bench_local_head.py --vocab --out DIR/vocab_ce.csv   # the vocabulary CE head alone

--vocab: the CE shapes a language model's head takes, (N, D, V) = (4096, 512, 32000),
(4096, 4096, 128256), (16384, 256, 256) and the transformer's (b32 s128: N = 4096, D = 256-2048,
V = 256), bf16, against every baseline that installs (Liger and cut-cross-entropy travel as wheels:
benchmarks/run_gpu_checks.sh installs .whl/; PyTorch's chunked `linear_cross_entropy` from torch 2.13), with
every vocabulary path where V > 512 (`ours-recompute`, `ours-vocab_chunks`,
`ours-row_chunks`, `ours-cublas`, `ours-cublas_vocab_chunks` and, where N <= D, `ours-cublas_in_place`:
LaunchConfig(vocab_path=...), also at other chunk sizes, and the Triton
paths at occupancy 1/8; `ours-cublas bias=None` and `ours-cublas bias=None two_pass=True` where V <= 32768:
without a bias, its softmax kernel holding each row (read once) or the two-read form a bias takes; `ours` where
V <= 512). --shapes N:D:V,... picks others. --tune: the chunked paths alone over VOCAB_TUNE's tiles, warps and
pipelining depths.

Each row: one head call (logits, loss, grad_h, grad_W, grad_b). `floor_us` is the
larger of bytes/copy-bandwidth (copy bandwidth measured in this run) and 3 GEMMs at
790 TFLOP/s. `peak_mb`: memory a call allocates above what was live before it, measured over two
calls on a fresh stream, so the fused head's per-stream scratch counts like a baseline's
temporaries; that includes cuBLAS' workspaces for the stream (32 MiB each on an H100), which every
method using cuBLAS allocates on its first GEMM there. `peak_mb_cublas_warm`: the same on a fresh stream
where a GEMM and a GEMM with a bias ran first, as a model's layers would have: the head's own scratch
counts, PyTorch's cuBLAS workspaces do not. Also: tile/occupancy variants of our kernel, host time per call and kernel
launches per call.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton.testing

from erase_triton import LaunchConfig, fused_local_head
from erase_triton.kernels.vocab_ce_cublas import ONE_PASS_MAX_C
from erase_triton.bench import copy_bandwidth_gbs, host_us, metadata, peak_mb, print_table, write_csv
from erase_triton.reference import head_loss

MATMUL_TFLOPS = 790.0


def make(loss, N, D, C, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(N, D, device="cuda", dtype=dtype, generator=g)
    w = (torch.randn(C, D, device="cuda", generator=g) / D ** 0.5).to(dtype)
    b = torch.zeros(C, device="cuda", dtype=dtype)
    if loss == "ce":
        y = torch.randint(0, C, (N,), device="cuda", generator=g)
    else:
        y = torch.rand(N, C, device="cuda", generator=g).round()
    return h, w, b, y


def autograd_fn(fwd, h, w, b, y):
    """run(): the loss fwd(h, w, b, y) and its gradients in h, w and b (b None: no bias), by autograd."""
    ws = w.detach().requires_grad_(True)
    bs = b.detach().requires_grad_(True) if b is not None else None

    def run():
        hh = h.detach().requires_grad_(True)
        return torch.autograd.grad(fwd(hh, ws, bs, y), [hh, ws] + ([bs] if bs is not None else []))
    return run


def torch_fn(loss, h, w, b, y, compiled=None):
    fwd = compiled or (lambda hh, ww, bb, yy: head_loss(F.linear(hh, ww, bb), yy, loss, "mean", -100))
    return autograd_fn(fwd, h, w, b, y)


def liger_fn(h, w, b, y):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    crit = LigerFusedLinearCrossEntropyLoss()
    return autograd_fn(lambda hh, ww, bb, yy: crit(ww, hh, yy, bb), h, w, b, y)


def cce_fn(h, w, b, y, filter_eps="high"):
    # filter_eps="high" (CCE's default) skips gradient blocks it judges negligible; None computes them all.
    # No bias: CCE has none (the bias is zero here)
    from cut_cross_entropy import linear_cross_entropy

    return autograd_fn(lambda hh, ww, _, yy: linear_cross_entropy(hh, ww, yy, filter_eps=filter_eps), h, w, None, y)


def torch_chunked_fn(h, w, b, y):
    # PyTorch's own chunked linear_cross_entropy (torch.nn.LinearCrossEntropyOptions; torch >= 2.13)
    opts = torch.nn.LinearCrossEntropyOptions()
    return autograd_fn(lambda hh, ww, bb, yy: F.linear_cross_entropy(hh, ww, yy, linear_bias=bb, options=opts), h, w, b, y)


def ours_fn(loss, h, w, b, y, cfg=None):
    return lambda: fused_local_head(h, w, b, y, loss=loss, config=cfg)


def launches(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


CONFIGS = [  # (loss, N, D, C, dtype)
    ("bce", 1024, 128, 1, torch.bfloat16),
    ("bce", 16384, 512, 1, torch.bfloat16),
    ("bce", 65536, 1024, 1, torch.bfloat16),
    ("bce", 262144, 1024, 1, torch.bfloat16),
    ("bce", 65536, 1024, 6, torch.bfloat16),
    ("mse", 65536, 1024, 1, torch.bfloat16),
    ("bce", 65536, 1024, 1, torch.float32),
    ("ce", 1024, 128, 256, torch.bfloat16),
    ("ce", 4096, 256, 256, torch.bfloat16),
    ("ce", 4096, 512, 32000, torch.bfloat16),
    ("ce", 8192, 1024, 32000, torch.bfloat16),
]
TUNE = {  # kernel variants measured on two anchor configs
    ("bce", 65536, 1024, 1): [dict(block_n=bn, block_d=bd, num_warps=nw) for bn, bd, nw in
                              [(16, 1024, 4), (16, 1024, 8), (32, 1024, 4), (32, 1024, 8), (16, 1024, 2),
                               (128, 128, 8)]] +
                             [dict(block_n=16, block_d=1024, num_warps=4, num_stages=s) for s in (2, 3)],
    ("ce", 4096, 512, 32000): [dict(block_n=bn, block_v=bv, block_d=bd, num_warps=nw) for bn, bv, bd, nw in
                               [(64, 64, 256, 8), (64, 128, 256, 8), (64, 128, 512, 8), (128, 128, 256, 8),
                                (64, 256, 256, 8)]],
}
COMPILED = {("bce", 1024, 128, 1), ("bce", 65536, 1024, 1), ("bce", 262144, 1024, 1), ("ce", 1024, 128, 256),
            ("ce", 4096, 512, 32000)}  # torch.compile baseline on these (each costs a compile)
OCC = [1 / 32, 1 / 8, 1 / 4, 1 / 2, 1.0]
VOCAB = [(4096, 512, 32000), (4096, 4096, 128256), (16384, 256, 256), (4096, 256, 256), (4096, 512, 256),
         (4096, 1024, 256), (4096, 2048, 256)]
# chunk sizes of the chunked paths besides the host rule's ("cublas": rows, the rule's at least 1024; 448, the most
# rows a tile whose scratch, grad_W and grad_h come to less than 64 MiB at (4096, 512, 32000): 62.8 MiB)
CHUNK_SIZES = {"vocab_chunks": [1024, 4096, 8192], "row_chunks": [512, 1024, 4096], "cublas": [256, 448, 1024, 2048, 4096],
               "cublas_vocab_chunks": [2048, 4096, 8192]}
TRITON_CHUNKED = ("vocab_chunks", "row_chunks")  # the chunked Triton kernels: tiles and occupancy apply
# --vocab --tune: tiles, warps and pipelining depth of the chunked paths (block_n, block_v, block_d, num_warps, num_stages)
VOCAB_TUNE = [(128, 128, 128, 8, s) for s in (2, 4, 5)] + [
    (128, 256, 128, 8, 3), (128, 128, 256, 8, 3), (64, 128, 128, 4, 4), (256, 128, 128, 8, 3), (128, 128, 128, 4, 4)]


def parse_shapes(text: str) -> list:
    try:
        shapes = [tuple(int(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(t) != 3 or min(t) < 1 or t[2] < 2 for t in shapes):
        raise SystemExit(f"--shapes: expected N:D:V,... with positive N, D and V >= 2, got {text!r}")
    return shapes


def _have(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        print(f"# {module} not importable: skipping that baseline")
        return False


def tune_variants(loss, h, w, b, y) -> list:
    """--vocab --tune: each chunked path at its defaults and over VOCAB_TUNE."""
    out = []
    for path in TRITON_CHUNKED:
        out.append((f"ours-{path}", ours_fn(loss, h, w, b, y, LaunchConfig(vocab_path=path))))
        for bn, bv, bd, nw, ns in VOCAB_TUNE:
            cfg = LaunchConfig(vocab_path=path, block_n=bn, block_v=bv, block_d=bd, num_warps=nw, num_stages=ns)
            out.append((f"ours-{path} block_n={bn},block_v={bv},block_d={bd},num_warps={nw},num_stages={ns}",
                        ours_fn(loss, h, w, b, y, cfg)))
    return out


def compare_variants(args, loss, N, D, C, dtype, h, w, b, y, have_liger, have_cce, ms_call) -> list:
    """The baselines that install, our head (every vocabulary path by name where C > 512) and its tuning rows."""
    out = []
    if not args.no_compile and ((loss, N, D, C) in COMPILED or args.vocab):
        comp = torch.compile(lambda hh, ww, bb, yy: head_loss(F.linear(hh, ww, bb), yy, loss, "mean", -100))
        out.append(("torch.compile", torch_fn(loss, h, w, b, y, compiled=comp)))
    if loss == "ce" and args.vocab and hasattr(torch.nn, "LinearCrossEntropyOptions"):
        out.append(("torch.linear_cross_entropy", torch_chunked_fn(h, w, b, y)))
    if loss == "ce" and have_liger:
        out.append(("liger", liger_fn(h, w, b, y)))
    if loss == "ce" and have_cce and args.vocab:
        out.append(("cut-cross-entropy", cce_fn(h, w, b, y)))
        out.append(("cut-cross-entropy-exact", cce_fn(h, w, b, y, filter_eps=None)))
    if args.vocab and C > 512:  # every vocabulary path by name (the default is one of them), chunk sizes, 1/8 of the SMs
        out.append(("ours-recompute", ours_fn(loss, h, w, b, y, LaunchConfig(vocab_path="recompute"))))
        if N <= D:  # the logits fit in grad_W's memory
            out.append(("ours-cublas_in_place", ours_fn(loss, h, w, b, y, LaunchConfig(vocab_path="cublas_in_place"))))
        for path, sizes in CHUNK_SIZES.items():
            out.append((f"ours-{path}", ours_fn(loss, h, w, b, y, LaunchConfig(vocab_path=path))))
            for size in sizes:
                out.append((f"ours-{path} chunk_size={size}",
                            ours_fn(loss, h, w, b, y, LaunchConfig(vocab_path=path, chunk_size=size))))
        if C <= ONE_PASS_MAX_C:  # A/B without a bias: the row held and read once (the rule), or read twice
            out.append(("ours-cublas bias=None", ours_fn(loss, h, w, None, y, LaunchConfig(vocab_path="cublas"))))
            out.append(("ours-cublas bias=None two_pass=True",
                        ours_fn(loss, h, w, None, y, LaunchConfig(vocab_path="cublas", two_pass=True))))
        for path in ("recompute", *TRITON_CHUNKED) if ms_call else ():
            out.append((f"ours-{path} occupancy=0.125", ours_fn(loss, h, w, b, y, LaunchConfig(vocab_path=path, occupancy=0.125))))
    else:
        out.append(("ours", ours_fn(loss, h, w, b, y)))
    tune = TUNE.get((loss, N, D, C), []) if dtype == torch.bfloat16 and not args.vocab else []
    for kw in tune:
        out.append(("ours " + ",".join(f"{k}={v}" for k, v in kw.items()), ours_fn(loss, h, w, b, y, LaunchConfig(**kw))))
    if (loss, N, D, C) in (("bce", 65536, 1024, 1), ("ce", 4096, 512, 32000)) and dtype == torch.bfloat16 and not args.vocab:
        for occ in OCC:
            out.append((f"ours occupancy={occ:g}", ours_fn(loss, h, w, b, y, LaunchConfig(occupancy=occ))))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/local_head.csv")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--vocab", action="store_true", help="the vocabulary CE shapes against every baseline")
    ap.add_argument("--shapes", default=None, help="with --vocab: N:D:V,... instead of the default shapes")
    ap.add_argument("--tune", action="store_true", help="with --vocab: only the chunked paths, over VOCAB_TUNE's tiles")
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes) if args.shapes else VOCAB
    if not torch.cuda.is_available():
        raise SystemExit("bench_local_head.py needs a CUDA device")
    meta = metadata()
    bw = copy_bandwidth_gbs()
    meta["copy_gbs"] = round(bw, 1)
    print(f"# {meta['gpu']} torch {meta['torch']} triton {meta['triton']} copy {bw:.0f} GB/s", flush=True)
    have_liger, have_cce = _have("liger_kernel"), _have("cut_cross_entropy")
    rows = []
    configs = CONFIGS[:3] + CONFIGS[9:10] if args.quick else CONFIGS
    if args.vocab:
        configs = [("ce", N, D, V, torch.bfloat16) for N, D, V in shapes]
    for loss, N, D, C, dtype in configs:
        h, w, b, y = make(loss, N, D, C, dtype)
        e = h.element_size()
        nbytes = 2 * N * D * e + 2 * C * D * e + y.numel() * y.element_size()
        flops = 3 * 2 * N * D * C
        floor_us = max(nbytes / (bw * 1e9), flops / (MATMUL_TFLOPS * 1e12)) * 1e6
        ms_call = N * D * C <= 1e11  # a call takes milliseconds (above: up to a second on the recompute path)
        variants = [("torch", torch_fn(loss, h, w, b, y))]
        variants += (tune_variants(loss, h, w, b, y) if args.tune else
                     compare_variants(args, loss, N, D, C, dtype, h, w, b, y, have_liger, have_cce, ms_call))
        for name, fn in variants:
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                row = dict(loss=loss, N=N, D=D, C=C, dtype=str(dtype).replace("torch.", ""), variant=name,
                           us=ms * 1e3, floor_us=floor_us, pct_of_floor=100 * floor_us / (ms * 1e3),
                           gbs=nbytes / (ms * 1e-3) / 1e9, tflops=flops / (ms * 1e-3) / 1e12, peak_mb=peak_mb(fn, fresh_stream=True),
                           peak_mb_cublas_warm=peak_mb(fn, fresh_stream=True, cublas_warm=True))
                # launches and host time (2050 back-to-back calls): only where a call takes milliseconds
                if name in ("ours", "ours-recompute", "ours-vocab_chunks", "ours-row_chunks", "ours-cublas",
                            "ours-cublas_vocab_chunks", "ours-cublas_in_place", "torch") and N <= 4096 and ms_call \
                        and not args.tune:
                    row["launches"] = launches(fn)
                    row["host_us"] = host_us(fn)
            except Exception as ex:  # a baseline failing must not lose the other rows
                row = dict(loss=loss, N=N, D=D, C=C, dtype=str(dtype), variant=name, error=repr(ex)[:200])
            rows.append(row)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del h, w, b, y
        torch.cuda.empty_cache()
        write_csv(args.out, rows, meta)  # after every shape: a run cut short keeps what it measured
    print_table([r for r in rows if "us" in r and (args.tune or " " not in r["variant"])],
                ["loss", "N", "D", "C", "dtype", "variant", "us", "floor_us", "pct_of_floor", "tflops", "peak_mb", "peak_mb_cublas_warm",
                 "launches",
                 "host_us"])


if __name__ == "__main__":
    main()
