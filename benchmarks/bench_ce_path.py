"""Which kernel should a softmax-CE head with a few hundred classes take? The dense kernel
(a row tile's logits in registers, grad_W partials per row group) against the vocabulary
kernel (online log-sum-exp, grad_W from recomputed logits), and eager PyTorch, at the
transformer's head shapes, on the whole device and at occupancy 1/8 (beside the next forward).

    python benchmarks/bench_ce_path.py [--out benchmarks/results/ce_path.csv] [--vocab-only]
    python benchmarks/bench_ce_path.py --tiles --out benchmarks/results/ce_vocab_tiles.csv

Kernel time: replay of a CUDA graph of 20 calls (tune_dense_head.graph_us). Every
variant is checked against the float64 reference first. --tiles: a tile grid of the
vocabulary kernel (block_n x block_v x block_d x warps) at the transformer's head shapes.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata, print_table, write_csv  # noqa: E402
from tune_dense_head import _clear_plans, graph_us  # noqa: E402

from erase_triton import LaunchConfig, fused_local_head  # noqa: E402
from erase_triton.kernels import local_head as lh  # noqa: E402
from erase_triton.reference import local_head as local_head_reference  # noqa: E402

SHAPES = [(4096, 256, 256), (8192, 512, 256), (4096, 256, 128), (4096, 1024, 256), (4096, 256, 512)]
DENSE_TILES = [None, LaunchConfig(block_n=16, block_d=64, num_warps=4), LaunchConfig(block_n=32, block_d=64, num_warps=4),
               LaunchConfig(block_n=32, block_d=64, num_warps=8), LaunchConfig(block_n=16, block_d=128, num_warps=8),
               LaunchConfig(block_n=32, block_d=128, num_warps=8)]


def use_path(dense_max_c: int):
    lh.DENSE_CE_MAX_C = dense_max_c
    _clear_plans()


# The whole-device grid over bn 16-64 x bv 64-256 x bd 64-256 x 4/8 warps (C=256 D=256, H200:
# ce_vocab_tiles_full.csv) put 8 warps, bn 32-64, bv 64-128 and bd 128-256 in its top 5.
VOCAB_TILES = [LaunchConfig(block_n=bn, block_v=bv, block_d=bd, num_warps=8)
               for bn in (32, 64) for bv in (64, 128) for bd in (128, 256)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/ce_path.csv")
    ap.add_argument("--vocab-only", action="store_true", help="skip the dense-kernel variants")
    ap.add_argument("--tiles", action="store_true", help="tile grid of the vocabulary kernel (transformer shapes)")
    args = ap.parse_args()
    meta = metadata()
    rows = []
    shapes = [(4096, 256, 256), (8192, 512, 256)] if args.tiles else SHAPES
    for N, D, C in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(N, D, device="cuda", generator=g).bfloat16()
        w = (torch.randn(C, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
        b = torch.zeros(C, device="cuda").bfloat16()
        y = torch.randint(0, C, (N,), device="cuda", generator=g)
        ref = tuple(local_head_reference(h.double(), w.double(), b.double(), y, loss="ce"))
        hh = h.clone().requires_grad_()
        lin = torch.nn.Linear(D, C, device="cuda", dtype=torch.bfloat16)

        def torch_head():
            loss = torch.nn.functional.cross_entropy(lin(hh).float(), y)
            loss.backward()
        rows.append(dict(N=N, D=D, C=C, path="torch eager", occupancy="-", tiles="-", us=graph_us(torch_head)))
        print(rows[-1], flush=True)
        for path, max_c in (("vocab", 64),) + (() if args.vocab_only or args.tiles else (("dense", 1 << 20),)):
            use_path(max_c)
            for occ in (None, 0.125):
                tiles = DENSE_TILES if path == "dense" else ([None] + VOCAB_TILES if args.tiles else [None])
                for t in tiles:
                    cfg = LaunchConfig(occupancy=occ) if t is None else LaunchConfig(
                        occupancy=occ, block_n=t.block_n, block_v=t.block_v, block_d=t.block_d, num_warps=t.num_warps)
                    name = "auto" if t is None else f"bn={t.block_n},bv={t.block_v},bd={t.block_d},nw={t.num_warps}"
                    row = dict(N=N, D=D, C=C, path=path, occupancy=occ or 1.0, tiles=name)
                    try:
                        out = fused_local_head(h, w, b, y, loss="ce", config=cfg)
                        row["max_rel_err"] = max(((o.double() - r).norm() / r.norm()).item() for o, r in zip(out, ref))
                        row["us"] = graph_us(lambda: fused_local_head(h, w, b, y, loss="ce", config=cfg))
                    except Exception as ex:  # a tile that does not fit must not lose the study
                        row["error"] = repr(ex)[:160]
                    rows.append(row)
                    print(rows[-1], flush=True)
        write_csv(args.out, rows, meta)
    use_path(64)
    best = {}
    for r in rows:
        if "us" in r and r.get("max_rel_err", 0) < 2e-2:
            k = (r["N"], r["D"], r["C"], r["path"], r["occupancy"])
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    print_table(list(best.values()), ["N", "D", "C", "path", "occupancy", "tiles", "us", "max_rel_err"])


if __name__ == "__main__":
    main()
