"""Does a step captured inside one torch.autocast("cuda") see in-place updates of its fp32 weights on replay?

    python3 tests/autocast_capture_check.py            # the library's capture (autocast's cache off)
    python3 tests/autocast_capture_check.py --cache-on  # the control: capture with autocast's cache left on

Captures an erase step of a 3-block LocalChain inside one autocast region, replays it, negates the blocks'
fp32 weights in place (what an optimizer does), replays again, and compares the step's output (the last block's)
with an eager autocast step on the updated weights. Prints one line: "fresh" (the replay re-cast the weights) or
"stale", and exits 0 for fresh, 1 for stale (`--cache-on` is the control: it must print "stale").
(Not the loss: it stays near log 2 either way, and its last bits vary with the head's float atomics.)
Each run is one fresh process (what autocast caches is per thread and lives until the outermost autocast exits).
tests/test_gpu.py runs it both ways.
"""
import argparse
import contextlib
import sys

import torch
from torch import nn

import erase_triton as et
from erase_triton.scheduler import graphs as scheduler


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-on", action="store_true", help="capture with autocast's cast cache on")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    if args.cache_on:
        scheduler._autocast_cache_off = lambda device="cuda": contextlib.nullcontext()
    torch.manual_seed(0)
    dev = "cuda"
    model = et.LocalChain([nn.Sequential(nn.Linear(128, 128), nn.ReLU()) for _ in range(3)], 128, 1, "bce").to(dev)
    x, y = torch.randn(512, 128, device=dev), torch.rand(512, device=dev).round()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        step = et.Scheduler("erase").capture(lambda a, b: model(a, b), x, y)
    before = step().float().clone()
    with torch.no_grad():
        for blk in model.blocks:
            blk[0].weight.mul_(-1.0)
    after = step().float().clone()
    with torch.autocast("cuda", dtype=torch.bfloat16), et.Scheduler("erase").step():
        eager = model(x, y).float()
    moved = float((after - before).abs().max() / before.abs().max())
    err = float((after - eager).abs().max() / eager.abs().max())
    fresh = moved > 0.1 and err < 0.02
    print(f"cache_on={int(args.cache_on)} replay output moved {moved:.3f} (of its max) by the update, "
          f"off the eager step by {err:.4f}: {'fresh' if fresh else 'stale'}")
    return 0 if fresh else 1


if __name__ == "__main__":
    sys.exit(main())
