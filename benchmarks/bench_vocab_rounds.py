"""The vocabulary CE head at one shape in interleaved rounds: ours (the default, chunk sizes, other paths, no
bias) against eager PyTorch and torch.compile of the same.

    python benchmarks/bench_vocab_rounds.py [--shape 4096:4096:128256] [--rounds 7] [--chunks 1024,2048]
        [--vocab-chunks 2048,3072] [--paths cublas_vocab_chunks] [--lt-gemms logits,grad_weight,grad_h,all,call]
        [--dz-stages 2,3] [--dz-tiles 64x128x8] [--dz-band-tiles 16x512x8] [--kernels 8]
        [--out benchmarks/results/vocab_rounds.csv]

At (4096, 4096, 128256) a single run moves by +-0.7 ms with the GPU's clocks, more than the chunk sizes
differ; every round times each variant once, in a rotated order, so the variants share the drift. Each
round gives do_bench's median (ms) of calls issued one after another, the replay of one call captured in a
CUDA graph (graphed_ms: what a captured step pays, the host's issue cost gone; NaN where capture fails) and
the kernel time of one call (torch profiler over three calls: graphed_ms less the gaps between kernels).
--chunks: `cublas` at those chunk sizes (rows); --vocab-chunks: `cublas_vocab_chunks` at those (classes);
--paths: other vocabulary paths at their own chunk rule (cublas_vocab_chunks on Hopper twice: with its Gluon
pass 1, the default there, and with its cuBLAS one).
--lt-gemms: `cublas_vocab_chunks` (at each --vocab-chunks size, else its rule) again with cuBLASLt as PyTorch's
preferred BLAS library for its GEMMs of one site ("logits", "grad_weight", "grad_h"), of all three ("all"), or
for the whole call ("call"); the default's library otherwise (its LT_GEMMS).
--dz-stages: `cublas_vocab_chunks` (at each --vocab-chunks size, else its rule; with and without a bias) again
with its dz kernels' loops software-pipelined that deep (DZ_STAGES; 0 is the plain loop).
--dz-tiles, --dz-band-tiles: `cublas_vocab_chunks` (at each --vocab-chunks size, else its rule) again with its
dz kernel's tile, ROWSxCOLUMNSxWARPS: with a bias dz_split_kernel's (VDZ_TILE), without one dz_band_kernel's
(VDZ_BAND_TILE).
Each variant without a bias (the default, and each --vocab-chunks size) has a twin "... bias=None", and eager
PyTorch one ("torch bias=None"), the baseline of those twins.
--kernels K: after the rounds, each variant's K costliest kernels (the torch profiler's calls of every round,
those kernel_ms comes from: us a call, launches a call, the kernel's name, which names cuBLAS' tile), printed and
written to <out stem>_kernels.csv.
The summary: medians and ranges, peak memory of one call (where cuBLAS already ran, as bench_local_head's
peak_mb_cublas_warm), and the median over rounds of each over eager and over torch.compile (a paired
estimate: a ratio within one round cancels drift slower than the round), issued and graphed; a variant
without a bias over eager without one ("torch bias=None"; torch.compile's is of the bias's call).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_local_head import make, ours_fn, torch_fn  # noqa: E402

from erase_triton import LaunchConfig  # noqa: E402
from erase_triton.bench import metadata, peak_mb, print_table, write_csv  # noqa: E402
from erase_triton.kernels import plan as kplan, vocab_ce_lse_gemm as lse_gemm  # noqa: E402
from erase_triton.kernels import vocab_ce_cublas_vocab_chunks as vchunks  # noqa: E402
from erase_triton.kernels.launch import VOCAB_PATHS  # noqa: E402
from erase_triton.reference import head_loss  # noqa: E402


def kernel_table(events, n: int) -> tuple[float, dict]:
    """(ms of kernels a call, {kernel name: [us a call, launches a call]}) from (name, us) kernel events of n
    calls."""
    per: dict = {}
    for name, us in events:
        t = per.setdefault(name, [0.0, 0.0])
        t[0] += us / n
        t[1] += 1 / n
    return sum(t[0] for t in per.values()) / 1e3, per


PROFILED_CALLS = 3  # calls profiled a variant a round (kernel_ms; --kernels' breakdown over every round's)


def kernel_events(fn, n: int = PROFILED_CALLS) -> list:
    """(name, us) of every kernel of n calls of fn under the torch profiler."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def graphed(fn):
    """A CUDA graph of one call of fn (warmed up on a side stream first, as torch.cuda.graphs asks), or None
    where fn cannot be captured (a host sync, a CPU op)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            fn()
    except RuntimeError as ex:
        print(f"# not capturable: {repr(ex)[:160]}", flush=True)
        return None
    return g


def with_setting(fn, module, name, value):
    """fn with module.name set to value for its call (a switch read when a call is prepared or runs) and put
    back after it. A switch read when a call is prepared needs fn's config to be its own, so its prepared call
    is too (the fast path keys on the config)."""
    def run():
        old = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn()
        finally:
            setattr(module, name, old)
    return run


LT_SITES = vchunks.LT_SITES


def with_lt_gemms(fn, sites: str):
    """fn with cublas_vocab_chunks' GEMMs of `sites` (one of LT_SITES, "all" or "call") computed with cuBLASLt
    preferred: LT_GEMMS set for the call, or for "call" the preference set around the whole call; both put
    back after it (a graph captured meanwhile keeps the kernels chosen)."""
    if sites != "call":
        return with_setting(fn, vchunks, "LT_GEMMS", frozenset(LT_SITES if sites == "all" else (sites,)))

    inner = with_setting(fn, vchunks, "LT_GEMMS", frozenset())

    def run():
        prev = torch._C._get_blas_preferred_backend()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return inner()
        finally:
            torch._C._set_blas_preferred_backend(prev)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096:4096:128256", help="N:D:V")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunks", default="1024,2048", help="chunk sizes (rows) of vocab_path='cublas' besides the default's")
    ap.add_argument("--vocab-chunks", default="", help="chunk sizes (classes) of vocab_path='cublas_vocab_chunks'")
    ap.add_argument("--paths", default="", help=f"other vocabulary paths at their own chunk rule, of {', '.join(VOCAB_PATHS)}")
    ap.add_argument("--lt-gemms", default="", help="cublas_vocab_chunks with cuBLASLt for GEMMs of these sites, "
                    f"of {', '.join(LT_SITES)}, all, call")
    ap.add_argument("--dz-stages", default="", help="cublas_vocab_chunks with its dz loops pipelined this deep")
    ap.add_argument("--dz-tiles", default="", help="cublas_vocab_chunks with these dz_split_kernel tiles, RxCxW")
    ap.add_argument("--dz-band-tiles", default="", help="cublas_vocab_chunks without a bias with these "
                    "dz_band_kernel tiles, RxCxW")
    ap.add_argument("--kernels", type=int, default=0, help="each variant's costliest kernels, this many")
    ap.add_argument("--out", default="benchmarks/results/vocab_rounds.csv")
    args = ap.parse_args()
    try:
        N, D, C = (int(x) for x in args.shape.split(":"))
        chunks = [int(x) for x in args.chunks.split(",") if x]
        vocab_chunks = [int(x) for x in args.vocab_chunks.split(",") if x]
        assert min(N, D, C, *chunks, *vocab_chunks) > 0
    except (ValueError, AssertionError):
        ap.error(f"--shape N:D:V, --chunks A,B,... and --vocab-chunks A,B,...: expected positive integers, "
                 f"got {args.shape!r}, {args.chunks!r} and {args.vocab_chunks!r}")
    paths = [p for p in args.paths.split(",") if p]
    if any(p not in VOCAB_PATHS for p in paths):
        ap.error(f"--paths: expected some of {', '.join(VOCAB_PATHS)}, got {args.paths!r}")
    lt_gemms = [x for x in args.lt_gemms.split(",") if x]
    if any(x not in LT_SITES + ("all", "call") for x in lt_gemms):
        ap.error(f"--lt-gemms: expected some of {', '.join(LT_SITES)}, all, call, got {args.lt_gemms!r}")
    try:
        dz_stages = [int(x) for x in args.dz_stages.split(",") if x]
        assert min(dz_stages, default=0) >= 0
    except (ValueError, AssertionError):
        ap.error(f"--dz-stages: expected non-negative integers, got {args.dz_stages!r}")
    dz_tiles = {}
    for opt, name in (("dz_tiles", "VDZ_TILE"), ("dz_band_tiles", "VDZ_BAND_TILE")):
        try:
            dz_tiles[name] = [tuple(int(v) for v in x.split("x")) for x in getattr(args, opt).split(",") if x]
            assert all(len(t) == 3 and min(t) > 0 for t in dz_tiles[name])
        except (ValueError, AssertionError):
            ap.error(f"--{opt.replace('_', '-')}: expected tiles as ROWSxCOLUMNSxWARPS (positive integers), "
                     f"got {getattr(args, opt)!r}")
    if args.kernels < 0:
        ap.error(f"--kernels: expected a non-negative integer, got {args.kernels}")
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive integer, got {args.rounds}")
    if not torch.cuda.is_available():
        sys.exit("bench_vocab_rounds.py times CUDA kernels: no CUDA device here")
    import triton

    h, w, b, y = make("ce", N, D, C, torch.bfloat16)
    comp = torch.compile(lambda hh, ww, bb, yy: head_loss(F.linear(hh, ww, bb), yy, "ce", "mean", -100))
    variants = {"torch": torch_fn("ce", h, w, b, y), "torch.compile": torch_fn("ce", h, w, b, y, compiled=comp),
                "ours": ours_fn("ce", h, w, b, y)}
    for cs in chunks:
        variants[f"ours chunk_size={cs}"] = ours_fn("ce", h, w, b, y, LaunchConfig(vocab_path="cublas", chunk_size=cs))
    for p in paths:
        variants[f"ours-{p}"] = ours_fn("ce", h, w, b, y, LaunchConfig(vocab_path=p))
        if p == "cublas_vocab_chunks" and lse_gemm.usable(h.device, h.dtype, D):  # Hopper: also its cuBLAS pass 1
            chunk = kplan.chunk_size_for(p, N, C, D, 2, 2, kplan.CUBLAS_COLUMN_TILE, LaunchConfig(),
                                         share=kplan.CUBLAS_VOCAB_SCRATCH_SHARE)
            # (the Gluon pass off when the call is prepared: the cuBLAS GEMM and chunk_lse_kernel a chunk; a
            # chunk_size of its own keeps its prepared call apart from the default's)
            variants[f"ours-{p} cuBLAS pass 1"] = with_setting(
                ours_fn("ce", h, w, b, y, LaunchConfig(vocab_path=p, chunk_size=chunk)), lse_gemm, "ENABLED", False)
    for cs in vocab_chunks:
        cfg = LaunchConfig(vocab_path="cublas_vocab_chunks", chunk_size=cs)
        variants[f"ours-cublas_vocab_chunks chunk_size={cs}"] = ours_fn("ce", h, w, b, y, cfg)
        variants[f"ours-cublas_vocab_chunks chunk_size={cs} bias=None"] = ours_fn("ce", h, w, None, y, cfg)
    # (LT_GEMMS is read when a call runs: these share the plain variants' prepared calls)
    for cs in vocab_chunks or [None]:
        cfg = LaunchConfig(vocab_path="cublas_vocab_chunks", chunk_size=cs)
        at = f" chunk_size={cs}" if cs else ""
        for sites in lt_gemms:
            variants[f"ours-cublas_vocab_chunks{at} cuBLASLt={sites}"] = with_lt_gemms(
                ours_fn("ce", h, w, b, y, cfg), sites)
        # switches read when a call is prepared: (label, switch, value, the biases it runs with), each variant
        # its own config; a tile of dz_band_kernel runs only without a bias
        prepared = [(f"dz_stages={st}", "DZ_STAGES", st, (b, None)) for st in dz_stages]
        prepared += [(f"dz_tile={'x'.join(map(str, t))}", name, t, (b,) if name == "VDZ_TILE" else (None,))
                     for name, tiles in dz_tiles.items() for t in tiles]
        for label, switch, value, biases in prepared:
            for bb in biases:
                cfg = LaunchConfig(vocab_path="cublas_vocab_chunks", chunk_size=cs)
                tail = "" if bb is not None else " bias=None"
                variants[f"ours-cublas_vocab_chunks{at} {label}{tail}"] = with_setting(
                    ours_fn("ce", h, w, bb, y, cfg), vchunks, switch, value)
    variants["ours bias=None"] = ours_fn("ce", h, w, None, y)
    variants["torch bias=None"] = torch_fn("ce", h, w, None, y)
    for fn in variants.values():  # compile, plan, allocate
        fn()
    mb = {name: peak_mb(fn, fresh_stream=True, cublas_warm=True) for name, fn in variants.items()}
    graphs = {name: graphed(fn) for name, fn in variants.items()}
    names = list(variants)
    rows, profiled = [], {name: [] for name in names}
    for rnd in range(args.rounds):
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            fn, g = variants[name], graphs[name]
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            gms = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median") if g else float("nan")
            events = kernel_events(fn)
            profiled[name] += events  # (the rounds' profiles also give --kernels' breakdown)
            rows.append(dict(N=N, D=D, C=C, round=rnd, variant=name, ms=ms, graphed_ms=gms,
                             kernel_ms=kernel_table(events, PROFILED_CALLS)[0], peak_mb_cublas_warm=mb[name]))
        print(f"round {rnd}: " + ", ".join(f"{r['variant']} {r['ms']:.2f} ({r['graphed_ms']:.2f} graphed)"
                                           for r in rows[-len(names):]), flush=True)
    meta = metadata()
    meta["command"] = "bench_vocab_rounds.py " + " ".join(sys.argv[1:])
    write_csv(args.out, rows, meta)
    per = {n: [r for r in rows if r["variant"] == n] for n in names}
    summary = []
    for n in names:
        ms = [r["ms"] for r in per[n]]
        s = dict(variant=n, median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms),
                 graphed_ms=statistics.median(r["graphed_ms"] for r in per[n]),
                 kernel_ms=statistics.median(r["kernel_ms"] for r in per[n]), peak_mb_cublas_warm=mb[n])
        for base in ("torch", "torch.compile"):
            ref = per["torch bias=None" if base == "torch" and n.endswith("bias=None") else base]
            s[f"over_{base}"] = statistics.median(a["ms"] / c["ms"] for a, c in zip(per[n], ref))
            s[f"graphed_over_{base}"] = statistics.median(a["graphed_ms"] / c["graphed_ms"]
                                                          for a, c in zip(per[n], ref))
        summary.append(s)
    if args.kernels:
        krows = []
        for n in names:
            _, table = kernel_table(profiled[n], PROFILED_CALLS * args.rounds)
            top = sorted(table.items(), key=lambda kv: -kv[1][0])[:args.kernels]
            krows += [dict(variant=n, rank=i, us=us, launches=k, kernel=name[:160])
                      for i, (name, (us, k)) in enumerate(top)]
        write_csv(os.path.splitext(args.out)[0] + "_kernels.csv", krows, meta)
        for r in krows:
            print(f"{r['variant'][:60]:60s} {r['us']:8.1f} us x{r['launches']:5.1f}  {r['kernel'][:100]}")
    print_table(summary, ["variant", "median_ms", "min_ms", "max_ms", "graphed_ms", "kernel_ms", "peak_mb_cublas_warm",
                          "over_torch", "over_torch.compile", "graphed_over_torch", "graphed_over_torch.compile"])


if __name__ == "__main__":
    main()
