"""The two SM-partitioning levers PyTorch offers, tried on graphed erase steps (issue 5, item 6).

    python benchmarks/bench_partition.py [--out benchmarks/results/partition.csv]

* cuBLAS SM carveout (`torch._C._set_sm_carveout_experimental(n)`): GEMMs leave n SMs
  free, so a head or a backward on another stream finds room.
* Green contexts (`torch.cuda.green_contexts`): the fused head kernel runs on a stream of
  a green context limited to n SMs (instead of its own occupancy-sized grid).
  Block backwards cannot move there: autograd runs each backward op on the stream of
  its forward op, so only the head kernel is ours to place.

Baseline: the library as shipped (heads at occupancy "auto"). Median step time of
graphed replays; sequential and e2e for reference.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import metadata, print_table, write_csv  # noqa: E402

import erase_triton.head as head_mod  # noqa: E402
from erase_triton.study import ctr_workload, time_step, transformer_workload  # noqa: E402


@contextlib.contextmanager
def carveout(n):
    torch._C._set_sm_carveout_experimental(n)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)


def green_stream(n_sms: int):
    from torch.cuda.green_contexts import GreenContext

    try:
        gc = GreenContext.create(num_sms=n_sms, device_id=torch.cuda.current_device())
    except TypeError:
        gc = GreenContext.create(n_sms, torch.cuda.current_device())
    return gc, gc.Stream()


@contextlib.contextmanager
def heads_on(stream):
    """Route every fused head kernel to `stream` (fork/join with events around it)."""
    orig = head_mod.local_head_into

    def on_stream(*a, **k):
        cur = torch.cuda.current_stream()
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            loss, grad_h = orig(*a, **k)
        cur.wait_stream(stream)
        grad_h.record_stream(cur)
        loss.record_stream(cur)
        return loss, grad_h

    head_mod.local_head_into = on_stream
    try:
        yield
    finally:
        head_mod.local_head_into = orig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/partition.csv")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    meta = metadata()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [("transformer w256 b32 s128", lambda: transformer_workload(256, 32, 128)),
             ("ctr w512 b4096", lambda: ctr_workload(512, 4096))]
    gc = None
    try:
        gc = green_stream(sms // 8)
    except Exception as ex:  # the lever may not exist on this torch/driver
        print(f"# green context unavailable: {ex!r}")
    variants = [("baseline", contextlib.nullcontext)]
    variants += [(f"cublas carveout {n}", lambda n=n: carveout(n)) for n in (sms // 8, sms // 4)]
    if gc is not None:
        variants.append((f"heads on green context {sms // 8} SMs", lambda: heads_on(gc[1])))
    rows = []
    for name, build in cases:
        for mode in ("e2e", "sequential", "erase"):
            for vname, ctx in variants:
                if mode != "erase" and vname != "baseline" and "carveout" not in vname:
                    continue
                row = dict(case=name, mode=mode, variant=vname)
                try:
                    with ctx():
                        model, inputs = build()
                        row["ms"] = time_step(model, inputs, mode, graphed=True)["ms"]
                except Exception as ex:
                    row["error"] = repr(ex)[:200]
                rows.append(row)
                print(row, flush=True)
                torch.cuda.synchronize()
    write_csv(args.out, rows, meta)
    base = {(r["case"], r["mode"]): r["ms"] for r in rows if r["variant"] == "baseline" and "ms" in r}
    for r in rows:
        if "ms" in r and (r["case"], r["mode"]) in base:
            r["vs_baseline"] = base[(r["case"], r["mode"])] / r["ms"]
    print_table(rows, ["case", "mode", "variant", "ms", "vs_baseline", "error"])


if __name__ == "__main__":
    main()
