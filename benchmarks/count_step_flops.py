"""Matmul work of one sequential step of the CTR proxy with a local head after every K-th subarchitecture.

A detach point spares its segment's first layer the gradient for its input, so fewer heads add
input-gradient GEMMs. This counts them with the PyTorch profiler (CPU, PyTorch heads, small sizes:
which GEMMs run does not depend on the device or the sizes; their FLOP shares depend a little on
the sizes, through the embedding projection and the heads).

    python benchmarks/count_step_flops.py [--head-every 1,2,3] [--width 128] [--batch 512]
"""
import argparse
import os
import sys

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_head_every, print_table  # noqa: E402

from erase_triton import Scheduler  # noqa: E402
from erase_triton.study import ctr_workload  # noqa: E402


def _mnk(e) -> list[int]:
    """Sorted (M, N, K) of a profiled mm / addmm (its last two 2-D inputs; addmm's bias may be 2-D too)."""
    a, b = [s for s in e.input_shapes if len(s) == 2][-2:]
    return sorted((a[0], b[1], a[1]))


def step_matmuls(k: int, width: int, batch: int) -> dict:
    model, inputs = ctr_workload(width, batch, device="cpu", rows=1000, head_every=k, backend="torch")
    with Scheduler("sequential").step():  # warm-up
        model(*inputs)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        with Scheduler("sequential").step():
            model(*inputs)
    mms = [e for e in prof.events() if e.name in ("aten::mm", "aten::addmm")]
    square = [e for e in mms if _mnk(e) == sorted((batch, width, width))]  # the subarchitectures' GEMMs
    return dict(head_every=k, matmuls=len(mms), width_x_width=len(square), gflop=sum(e.flops for e in mms) / 1e9)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-every", default="1,2,3")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=512)
    args = ap.parse_args()
    rows = [step_matmuls(k, args.width, args.batch) for k in parse_head_every(args.head_every)]
    for r in rows:
        r["gflop_vs_k1"] = r["gflop"] / rows[0]["gflop"]
    print_table(rows, ["head_every", "matmuls", "width_x_width", "gflop", "gflop_vs_k1"])


if __name__ == "__main__":
    main()
