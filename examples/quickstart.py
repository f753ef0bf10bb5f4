"""The README's API in one runnable file: a six-block model with a LocalHead after every block,
trained in the three modes on a synthetic click task, then (on CUDA) the erase step captured in
one CUDA graph, and early updates.

    python examples/quickstart.py [--steps 300] [--width 256] [--batch 1024] [--compile]

On a CPU the heads run their PyTorch reference and erase has sequential semantics (no streams);
the numbers are the same math. On CUDA the heads are the fused Triton kernels.
"""
from __future__ import annotations

import argparse
import time

import torch

import erase_triton as et
from erase_triton.bench import median_ms


class Net(torch.nn.Module):
    """Six Linear+ReLU blocks; a BCE LocalHead after each (the last one final)."""

    def __init__(self, width: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(6))
        self.heads = torch.nn.ModuleList(et.LocalHead(width, 1, "bce", final=(i == 5)) for i in range(6))

    def forward(self, x, y):
        h = x
        for block, head in zip(self.blocks, self.heads):
            h = head(block(h), y)  # loss + grads now, backward into `block` now, returns h.detach()
        return h

    @torch.no_grad()
    def accuracy(self, x, y) -> float:
        h = x
        for block in self.blocks:
            h = block(h)
        return ((self.heads[-1].logits(h).squeeze(-1) > 0).float() == y).float().mean().item()


def batch(n: int, width: int, teacher: torch.Tensor, g: torch.Generator, device):
    x = torch.randn(n, width, generator=g).to(device)
    y = ((x @ teacher).relu().sum(-1) > teacher.shape[1] * 0.4).float()  # a non-linear click rule
    return x, y


def train(mode: str, args, device, teacher) -> dict:
    torch.manual_seed(0)
    model = Net(args.width).to(device)
    if args.compile:
        et.compile_blocks(model)
    # capturable: Adam keeps its step count on the device, so the CUDA graph below can replay its step
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=device.type == "cuda")
    sched = et.Scheduler(mode)
    g = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    for _ in range(args.steps):
        x, y = batch(args.batch, args.width, teacher, g, device)
        with sched.step():  # no loss.backward(): the heads did it
            opt.zero_grad(set_to_none=True)
            model(x, y)
            opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t) / args.steps
    x, y = batch(4096, args.width, teacher, torch.Generator().manual_seed(1), device)
    return dict(mode=mode, loss=model.heads[-1].last_loss.item(), accuracy=model.accuracy(x, y), ms=ms,
                model=model, opt=opt)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--compile", action="store_true", help="compile the blocks between the heads (et.compile_blocks)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher = torch.randn(args.width, 16, generator=torch.Generator().manual_seed(2)).to(device) / args.width ** 0.5

    print(f"six blocks of width {args.width}, batch {args.batch}, {args.steps} Adam steps on {device}")
    runs = {mode: train(mode, args, device, teacher) for mode in ("e2e", "sequential", "erase")}
    for r in runs.values():
        print(f"  {r['mode']:10}  final-head loss {r['loss']:.4f}   accuracy {r['accuracy']:.3f}   "
              f"{r['ms']:.2f} ms/step (eager, host included)")

    if device.type == "cuda":  # the whole erase step in one CUDA graph, then early updates
        model, opt = runs["erase"]["model"], runs["erase"]["opt"]
        x_static, y_static = batch(args.batch, args.width, teacher, torch.Generator().manual_seed(3), device)
        sched = et.Scheduler("erase")
        step = sched.capture(lambda x, y: (opt.zero_grad(set_to_none=True), model(x, y), opt.step()),
                             x_static, y_static)
        print(f"  erase, graphed: {median_ms(step):.3f} ms/step")
        early = et.Scheduler("erase", optimizer=opt)  # each block's Adam step right after its backward
        step = early.capture(lambda x, y: (opt.zero_grad(set_to_none=True), model(x, y)), x_static, y_static)
        print(f"  erase, graphed, early updates: {median_ms(step):.3f} ms/step")
        early.optimizer = None  # give the optimizer back (a direct opt.step() works again)
    return runs


if __name__ == "__main__":
    main()
