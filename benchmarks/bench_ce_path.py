"""Which kernel should a softmax-CE head with a few hundred classes take? The small-vocabulary
kernel (a row tile's C logits in registers, dz through L2 scratch, grad_W as a GEMM split over
output tiles and row groups), the dense kernel (grad_W partials per row group), the vocabulary
kernel (online log-sum-exp, grad_W from recomputed logits), and eager PyTorch, at the
transformer's head shapes, on the whole device and at occupancy 1/8 (beside the next forward).

    python benchmarks/bench_ce_path.py [--out benchmarks/results/ce_path.csv] [--paths small,vocab,dense]
                                       [--shapes "N,D,C;N,D,C"] [--dtype bf16|fp32]
    python benchmarks/bench_ce_path.py --tiles --out benchmarks/results/ce_small_tiles.csv
    python benchmarks/bench_ce_path.py --tiles --sets "GH_T=0;BLOCK_N=128,NUM_STAGES=2" --occupancies 0.125

Kernel time: replay of a CUDA graph of 20 calls (tune_dense_head.graph_us). Every
variant is checked against the float64 reference first. --tiles: a tile grid of the
small-vocabulary kernel (phase A row tile and chunks, phase B output tile, warps, stages)
at the transformer's head shapes; benchmarks/compile_report.py shows which sets spill.
--sets replaces that grid with the given constexpr sets (study_small_ce.sh).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata, print_table, write_csv  # noqa: E402
from tune_dense_head import _clear_plans, blocks_override, graph_us  # noqa: E402

from erase_triton import LaunchConfig, fused_local_head  # noqa: E402
from erase_triton.kernels import local_head as lh  # noqa: E402
from erase_triton.reference import local_head as local_head_reference  # noqa: E402

SHAPES = [(4096, 256, 256), (8192, 512, 256), (8192, 1024, 256), (4096, 256, 128), (4096, 256, 512)]
DENSE_TILES = [None, LaunchConfig(block_n=32, block_d=64, num_warps=8)]
# path -> (DENSE_CE_MAX_C, SMALL_CE_MAX_C): which kernel C = 65..512 takes ("library": the default routing)
PATHS = {"small": (64, 512), "vocab": (64, 64), "dense": (1 << 20, 1 << 20),
         "library": (lh.DENSE_CE_MAX_C, lh.SMALL_CE_MAX_C)}


def use_path(path: str):
    lh.DENSE_CE_MAX_C, lh.SMALL_CE_MAX_C = PATHS[path]
    _clear_plans()


# sets that ptxas compiles with no or few spills at C=256, bf16 (compile_report.py), around the default
# (BLOCK_N=64, chunks of 64, [128, 128] phase-B tiles, 8 warps, 3 stages)
SMALL_TILES = [dict(BLOCK_N=64, BLOCK_K=64, BLOCK_DC=64, num_warps=8, BLOCK_CW=cw, BLOCK_DW=dw, NUM_STAGES=st)
               for cw, dw in ((128, 128), (64, 128), (256, 64)) for st in (2, 3)] + [
               dict(BLOCK_N=64, BLOCK_K=32, BLOCK_DC=32, num_warps=8, NUM_STAGES=3),
               dict(BLOCK_N=128, BLOCK_K=64, BLOCK_DC=64, num_warps=16, NUM_STAGES=2),
               dict(BLOCK_N=64, BLOCK_K=64, BLOCK_DC=64, num_warps=4, NUM_STAGES=3),
               dict(PHASES=1), dict(PHASES=2)]  # the default stopped after phase A / B: phase times by difference


def parse_set(text: str) -> dict:
    """'K=V,K=V' -> {K: int(V)} (constexpr overrides; num_warps among them)."""
    return {k: int(v) for k, v in (kv.split("=", 1) for kv in text.split(",") if kv)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/ce_path.csv")
    ap.add_argument("--paths", default="small,vocab,dense", help="kernels to time, comma-separated")
    ap.add_argument("--tiles", action="store_true", help="tile grid of the small-vocabulary kernel (transformer shapes)")
    ap.add_argument("--sets", default=None,
                    help="with --tiles: constexpr sets to time instead of the built-in grid, "
                         "'K=V,K=V;K=V' (e.g. 'GH_T=1;BLOCK_DC=128,NUM_STAGES=2')")
    ap.add_argument("--occupancies", default="1,0.125", help="comma-separated fractions (1: the whole device)")
    ap.add_argument("--shapes", default=None, help="N,D,C triples separated by ';' (default: the transformer's)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="h and W dtype (fp32: tf32 dots)")
    args = ap.parse_args()
    meta = metadata()
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32: PyTorch and the kernels both take tf32 dots
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    rows = []
    shapes = [(4096, 256, 256), (8192, 512, 256)] if args.tiles else SHAPES
    small_tiles = SMALL_TILES if args.sets is None else [parse_set(t) for t in args.sets.split(";")]
    occs = [None if float(o) == 1.0 else float(o) for o in args.occupancies.split(",")]
    if args.shapes:
        shapes = [tuple(int(v) for v in t.split(",")) for t in args.shapes.split(";")]
    for N, D, C in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(N, D, device="cuda", generator=g).to(dtype)
        w = (torch.randn(C, D, device="cuda", generator=g) / D ** 0.5).to(dtype)
        b = torch.zeros(C, device="cuda").to(dtype)
        y = torch.randint(0, C, (N,), device="cuda", generator=g)
        ref = tuple(local_head_reference(h.double(), w.double(), b.double(), y, loss="ce"))
        hh = h.clone().requires_grad_()
        lin = torch.nn.Linear(D, C, device="cuda", dtype=dtype)

        def torch_head():
            loss = torch.nn.functional.cross_entropy(lin(hh).float(), y)
            loss.backward()
        rows.append(dict(N=N, D=D, C=C, dtype=args.dtype, path="torch eager", occupancy="-", tiles="-",
                         us=graph_us(torch_head)))
        print(rows[-1], flush=True)
        for path in (["small"] if args.tiles else args.paths.split(",")):
            use_path(path)
            for occ in occs:
                tiles = DENSE_TILES if path == "dense" else ([None] + small_tiles if args.tiles else [None])
                for t in tiles:
                    over = {}
                    if isinstance(t, dict):  # small-kernel constexprs
                        cfg, over = LaunchConfig(occupancy=occ), t
                        name = ",".join(f"{k}={v}" for k, v in t.items())
                    elif t is None:
                        cfg, name = LaunchConfig(occupancy=occ), "auto"
                    else:
                        cfg = LaunchConfig(occupancy=occ, block_n=t.block_n, block_v=t.block_v, block_d=t.block_d,
                                           num_warps=t.num_warps)
                        name = f"bn={t.block_n},bv={t.block_v},bd={t.block_d},nw={t.num_warps}"
                    row = dict(N=N, D=D, C=C, dtype=args.dtype, path=path, occupancy=occ or 1.0, tiles=name)
                    try:
                        with blocks_override("_small_ce_blocks", **over):
                            out = fused_local_head(h, w, b, y, loss="ce", config=cfg)
                            if over.get("PHASES", 3) == 3:  # a stopped kernel leaves outputs unwritten
                                row["max_rel_err"] = max(((o.double() - r).norm() / r.norm()).item()
                                                         for o, r in zip(out, ref))
                            row["us"] = graph_us(lambda: fused_local_head(h, w, b, y, loss="ce", config=cfg))
                    except Exception as ex:  # a tile that does not fit must not lose the study
                        row["error"] = repr(ex)[:160]
                    rows.append(row)
                    print(rows[-1], flush=True)
        write_csv(args.out, rows, meta)
    use_path("library")  # the library's own routing again
    best = {}
    for r in rows:
        if "us" in r and "max_rel_err" in r and r["max_rel_err"] < 2e-2:  # (PHASES rows stop early: no error)
            k = (r["N"], r["D"], r["C"], r["path"], r["occupancy"])
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    print_table(list(best.values()), ["N", "D", "C", "dtype", "path", "occupancy", "tiles", "us", "max_rel_err"])


if __name__ == "__main__":
    main()
