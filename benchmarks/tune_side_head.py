"""The MLP proxy's BCE heads (C=1) at the schedule's sizes, alone on the GPU: how the
atomic mode's grid shape changes their time. With the default static split each program of a
1/8-occupancy head takes every P-th row tile (8-row tiles since session 7; 16-row tiles, one a
program, when side_head.csv was measured); claimed groups of k tiles (LaunchConfig group_tiles=k)
cut the programs, and their end-of-kernel atomics, k-fold. H200 (side_head.csv): the groups were
slower at every size; a 1/8 head is latency-bound by its share of SMs (N=4096 D=512 bf16: 21 us at
1/8, 8.9 us on the whole device, with 16-row tiles).

    python benchmarks/tune_side_head.py [--out benchmarks/results/side_head.csv]
    python benchmarks/tune_side_head.py --tiles --out benchmarks/results/side_head_tiles.csv

--tiles: rows per tile x warps x pipeline stages of the static split, at 1/8 (the side
heads) and on the whole device (the final head), at the b1024 and b4096 sizes; each variant
is checked against the default launch and records its grid (P) and registers.
--grid: LaunchConfig(programs_per_sm=1, 2, 3) against the default grid rule, same cases:
fewer programs, more row tiles each, fewer end-of-kernel atomics.
--regs: ptxas register caps (LaunchConfig(max_registers=...)) x 1-3 pipeline stages, same cases:
fewer registers a thread, more programs an SM, more row tiles in flight.
--two-pass: LaunchConfig(two_pass=True) (dz of a program's tiles first, then grad_h and grad_W
from h read again) x rows per tile x warps x pipeline stages, against the default launch.
--stream: the default launch against `stream_head` (the same bytes, tiles and grid, none of
the head's math), same cases, with and without the ReLU in the head.

Kernel time: replay of a CUDA graph of 20 calls (tune_dense_head.graph_us).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata, print_table, write_csv  # noqa: E402
from tune_dense_head import bce_anchor, graph_us, measure_variant  # noqa: E402

from erase_triton import LaunchConfig, fused_local_head  # noqa: E402
from erase_triton import functional as fn  # noqa: E402
from erase_triton.reference import local_head as local_head_reference  # noqa: E402

SHAPES = [(1024, 256), (1024, 512), (4096, 512)]
GROUPS = [None, 2, 4, 8, 16]
# (dtype, N, occupancy) of the tile study: the side heads at 1/8, the final head whole-device
TILE_CASES = [("tf32", 1024, 0.125), ("bf16", 4096, 0.125), ("tf32", 4096, 0.125), ("bf16", 4096, None),
              ("tf32", 4096, None)]
TILES = [(bn, nw, st) for bn in (8, 16, 32, 64) for nw in (2, 4, 8) for st in (1, 2, 3)
         if 32 <= bn * 512 // (32 * nw) <= 256]


def _study(variants, D: int = 512) -> list[dict]:
    """Each TILE_CASES head launched with each (name, LaunchConfig kwargs) of variants(), checked
    against the default launch."""
    rows = []
    for dname, N, occ in TILE_CASES:
        dtype = torch.bfloat16 if dname == "bf16" else torch.float32
        h, w, b, y, floor_us = bce_anchor(N, D, 4300.0, dtype)
        base = fused_local_head(h, w, b, y, config=LaunchConfig(occupancy=occ))
        for name, kw, *over in variants():  # (name, LaunchConfig kwargs[, constexpr overrides])
            rows.append(measure_variant(dict(dtype=dname, N=N, D=D, occupancy=occ or 1.0, variant=name,
                                             floor_us=floor_us), h, w, b, y, base, floor_us,
                                        LaunchConfig(occupancy=occ, **kw), over[0] if over else None))
    return rows


def tile_study() -> list[dict]:
    return _study(lambda: [("default", {})] + [(f"bn={bn},nw={nw},st={st}", dict(block_n=bn, num_warps=nw, num_stages=st))
                                               for bn, nw, st in TILES])


def stream_study() -> list[dict]:
    """The fused head against `stream_head` (its bytes, tiles and grid without its math) alone,
    TILE_CASES, with and without the ReLU in the head (relu(h) written by the kernel), and the
    dissection: the stream kernel with the fused kernel's row reduction, dz and loss put back
    (+dz; also with h loaded again after the reduction, and on 4 warps), and then its float-atomic
    sums (atomics), the last-out counter (counter) and the last program's sum too (tail: the fused
    C=1 BCE path rebuilt). Also each kernel's grid, registers, spills and shared memory."""
    from erase_triton.kernels.stream_head import dissect_outputs, stream_head
    rows = []
    for dname, N, occ in TILE_CASES:
        dtype = torch.bfloat16 if dname == "bf16" else torch.float32
        D = 512
        h, w, b, y, floor_us = bce_anchor(N, D, 4300.0, dtype)
        dz = torch.randn(N, device="cuda")
        y1 = y.reshape(N)
        outs = dissect_outputs(D, "cuda", dtype)
        cfg = LaunchConfig(occupancy=occ)
        for relu in (False, True):
            act = torch.empty_like(h) if relu else None
            kw = dict(activation="relu") if relu else {}
            ref = fused_local_head(h, w, b, y, config=cfg, **kw)
            row = dict(dtype=dname, N=N, D=D, occupancy=occ or 1.0, relu=int(relu), floor_us=floor_us,
                       fused_us=graph_us(lambda: fused_local_head(h, w, b, y, config=cfg, **kw)))
            hl = list(fn._FAST.values())[-1][0]
            ck = hl.compiled
            row["fused_grid"] = (f"P={hl.P} regs={getattr(ck, 'n_regs', None)} spills={getattr(ck, 'n_spills', None)} "
                                 f"smem={int(ck.metadata.shared)}")
            bce = dict(y=y1, bias=b, scale=1.0 / N)
            for name, dis, c in (("stream", None, cfg), ("stream_dz", bce, cfg),
                                 ("stream_dz_reload", dict(bce, reload=True), cfg),
                                 ("stream_dz_4warps", bce, LaunchConfig(occupancy=occ, num_warps=4)),
                                 ("stream_dz_atomics", dict(bce, outputs=outs, tail=1), cfg),
                                 ("stream_dz_counter", dict(bce, outputs=outs, tail=2), cfg),
                                 ("stream_dz_tail", dict(bce, outputs=outs), cfg)):
                row[f"{name}_us"] = graph_us(lambda: stream_head(h, dz, w, relu=relu, act_out=act, config=c,
                                                                dissect=dis))
                info = {}
                stream_head(h, dz, w, relu=relu, act_out=act, config=c, dissect=dis, info=info)
                row[f"{name}_grid"] = "P={P} regs={n_regs} spills={n_spills} smem={shared}".format(**info)
                outs[3].zero_()  # (tail=1 leaves the accumulators dirty)
            g = stream_head(h, dz, w, relu=relu, act_out=act, config=cfg,
                            dissect=dict(y=y1, bias=b, scale=1.0 / N, outputs=outs))
            row["rebuilt_matches_fused"] = bool(torch.allclose(g.float(), ref.grad_h.float(), rtol=2e-2, atol=1e-6)
                                                and torch.allclose(outs[0].float(), ref.grad_weight.float(), rtol=2e-2,
                                                                   atol=1e-5)
                                                and torch.allclose(outs[2][0], ref.loss, rtol=1e-3))
            row["fused_over_stream"] = row["fused_us"] / row["stream_us"]
            rows.append(row)
            print(row, flush=True)
    return rows


def regs_study() -> list[dict]:
    return _study(lambda: [("default", {}), ("tail in 512-wide passes", {}, dict(BLOCK_R=512)),
                           ("8 accumulator copies", {}, dict(ACC_COPIES=8))]
                  + [(f"maxnreg={r or 'rule'},st={st}", dict(max_registers=r, num_stages=st))
                     for r in (None, 168, 128, 112, 96, 80, 64) for st in (1, 2, 3)])


def two_pass_study() -> list[dict]:
    return _study(lambda: [("default", {})] + [(f"two_pass bn={bn},nw={nw},st={st}",
                                                dict(two_pass=True, block_n=bn, num_warps=nw, num_stages=st))
                                               for bn in (4, 8, 16, 32) for nw in (2, 4) for st in (1, 2, 3)
                                               if bn * 512 // (32 * nw) <= 128])


def grid_study() -> list[dict]:
    return _study(lambda: [("default", {})] + [(f"programs_per_sm={k}", dict(programs_per_sm=k)) for k in (1, 2, 3)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/side_head.csv")
    ap.add_argument("--tiles", action="store_true", help="the tile study (TILE_CASES x TILES)")
    ap.add_argument("--grid", action="store_true", help="programs_per_sm 1-3 against the default grid (TILE_CASES)")
    ap.add_argument("--regs", action="store_true",
                    help="LaunchConfig(max_registers=...) x pipeline stages against the default (TILE_CASES)")
    ap.add_argument("--stream", action="store_true", help="fused head vs stream_head (its bytes without its math)")
    ap.add_argument("--two-pass", action="store_true",
                    help="LaunchConfig(two_pass=True) x tiles x warps x stages against the default (TILE_CASES)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.stream:
        rows = stream_study()
        write_csv(args.out, rows, metadata())
        print_table(rows, ["dtype", "N", "occupancy", "relu", "fused_us", "stream_us", "stream_dz_us",
                           "stream_dz_reload_us", "stream_dz_4warps_us", "stream_dz_atomics_us", "stream_dz_counter_us",
                           "stream_dz_tail_us", "rebuilt_matches_fused"])
        for r in rows:
            print(r["dtype"], r["N"], r["occupancy"], r["relu"], *(f"{k[:-5]}: {v}" for k, v in r.items()
                                                                   if k.endswith("_grid")), sep=" | ")
        return
    if args.tiles or args.grid or args.regs or args.two_pass:
        rows = (grid_study() if args.grid else regs_study() if args.regs else two_pass_study() if args.two_pass
                else tile_study())
        write_csv(args.out, rows, metadata())
        for dname, N, occ in TILE_CASES:
            case = [r for r in rows if (r["dtype"], r["N"], r["occupancy"]) == (dname, N, occ or 1.0)]
            ok = sorted([r for r in case if "us" in r and r["matches_default"]], key=lambda r: r["us"])
            print(f"# {dname} N={N} occupancy={occ or 1.0}: default and the 5 fastest", flush=True)
            print_table([r for r in case if r["variant"] == "default"] + ok[:5],
                        ["dtype", "N", "occupancy", "variant", "P", "n_regs", "n_spills", "us", "floor_us"])
        return
    rows = []
    for dname, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32)):
        for N, D in SHAPES:
            h, w, b, y, _ = bce_anchor(N, D, 1.0, dtype)
            ref = local_head_reference(h.double(), w.double(), b.double(), y.double())
            for occ in (0.125, None):
                for k in GROUPS:
                    cfg = LaunchConfig(occupancy=occ, group_tiles=k)
                    out = fused_local_head(h, w, b, y, config=cfg)
                    err = max(((o.double() - r).norm() / r.norm()).item() for o, r in zip(out, ref))
                    us = graph_us(lambda: fused_local_head(h, w, b, y, config=cfg))
                    rows.append(dict(dtype=dname, N=N, D=D, occupancy=occ or 1.0, group_tiles=k or "static",
                                     us=us, max_rel_err=err))
                    print(rows[-1], flush=True)
    write_csv(args.out, rows, metadata())
    print_table(rows, ["dtype", "N", "D", "occupancy", "group_tiles", "us", "max_rel_err"])


if __name__ == "__main__":
    main()
