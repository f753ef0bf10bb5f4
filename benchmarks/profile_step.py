"""Host cost of one eager training step, sequential vs erase (MLP proxy w256 b1024 bf16,
fused heads, GPU idle between calls, so the step is host-bound and erase runs sequential's
path on the caller's stream): what the scheduler adds to the host's time.

    python benchmarks/profile_step.py [--rounds 400] [--out host_step.csv]

1. Host time to issue each call that a step's entry and exit make (device and stream
   lookups, capture check, event query and record).
2. Host time of an empty `with sched.step(): pass` per scheduler.
3. Host time of a whole step, the variants interleaved in shuffled rounds, and the paired
   estimate (median over rounds of sequential's time / the variant's in the same round),
   with a second sequential and a second erase scheduler as the A/A noise floor, and two
   variants that split erase's extra cost: sequential plus erase's event query and record,
   and erase's Python path without them.
4. cProfile of sequential and erase: the functions whose own time differs most.
"""
import argparse
import contextlib
import cProfile
import os
import pstats
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_us, metadata, print_table, write_csv  # noqa: E402

from erase_triton import Scheduler  # noqa: E402
from erase_triton.models import MLPChain  # noqa: E402
from erase_triton.train import training_step  # noqa: E402


def entry_calls():
    dev = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.current_stream(dev)
    ev = torch.cuda.Event()
    ev.record(s)
    torch.cuda.synchronize()
    return [
        ("torch.cuda.is_available()", torch.cuda.is_available),
        ("torch.cuda.current_device()", torch.cuda.current_device),
        ("torch.device('cuda', i)", lambda: torch.device("cuda", 0)),
        ("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev)),
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        ("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing),
        ("event.query() (done)", ev.query),
        ("event.record(stream)", lambda: ev.record(s)),
        ("torch.cuda.set_stream(s)", lambda: torch.cuda.set_stream(s)),
    ]


def empty_steps():
    out = []
    for name, sched in (("sequential", Scheduler("sequential")), ("erase", Scheduler("erase")),
                        ("erase always-fork", Scheduler("erase", adaptive=False))):
        def run(sched=sched):
            with sched.step():
                pass
        out.append((f"empty step: {name}", run))
    return out


class _SeqWithEvents(Scheduler):
    """Sequential plus exactly the CUDA calls adaptive erase adds: one event query at entry and
    one event record on the current stream at exit (is the event traffic itself the cost?)."""

    def __init__(self):
        super().__init__("sequential")
        self._ev = None

    @contextlib.contextmanager
    def step(self):
        if self._ev is not None:
            self._ev.query()
        with super().step():
            yield self
        if self._ev is None:
            self._ev = torch.cuda.Event()
        # as measured (host_step_s7d/e.csv): this public lookup adds ~8 µs that erase's cached one does not
        self._ev.record(torch.cuda.current_stream())


class _EraseNoEvents(Scheduler):
    """Adaptive erase's Python path without its CUDA event calls: always 'caught up', no end event."""

    def __init__(self):
        super().__init__("erase")

    def _gpu_caught_up(self):
        return True

    def _record(self, kind, index, stream):
        if kind != "end":
            return super()._record(kind, index, stream)


def whole_steps(rounds: int):
    torch.manual_seed(0)
    model = MLPChain(256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    y = torch.rand(1024, device="cuda").round().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = training_step(model, opt)
    variants = {"sequential": Scheduler("sequential"), "erase": Scheduler("erase"),
                "sequential again": Scheduler("sequential"), "erase again": Scheduler("erase"),
                "sequential + event query/record": _SeqWithEvents(), "erase without events": _EraseNoEvents()}
    runs = {}
    for name, sched in variants.items():
        def run(sched=sched):
            with sched.step():
                step(x, y)
        for _ in range(10):
            run()
        runs[name] = run
    torch.cuda.synchronize()
    host = {name: [] for name in runs}
    order, rng = list(runs), random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            t = time.perf_counter()
            runs[name]()
            host[name].append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()  # between rounds only: every step starts with the GPU idle
    rows = []
    for name in runs:
        paired = statistics.median(s / v for s, v in zip(host["sequential"], host[name]))
        rows.append(dict(part="whole step", name=name, host_us=1e3 * statistics.median(host[name]),
                         paired_seq_over_this=paired, forks=variants[name].last_forks))
    return rows, runs


def profile_diff(runs, n: int = 200):
    stats = {}
    for name in ("sequential", "erase"):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            runs[name]()
        pr.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(pr).stats  # (file, line, func) -> (cc, nc, tt, ct, callers)
        stats[name] = {f"{os.path.basename(k[0])}:{k[2]}": (v[1] / n, v[2] / n * 1e6) for k, v in st.items()}
    keys = set(stats["sequential"]) | set(stats["erase"])
    diff = sorted(keys, key=lambda k: -abs(stats["erase"].get(k, (0, 0))[1] - stats["sequential"].get(k, (0, 0))[1]))
    print("# cProfile, per step: calls and own µs, sequential vs erase (largest differences)")
    for k in diff[:20]:
        s, e = stats["sequential"].get(k, (0, 0)), stats["erase"].get(k, (0, 0))
        print(f"{k:60s} seq {s[0]:6.1f} calls {s[1]:8.1f} us | erase {e[0]:6.1f} calls {e[1]:8.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [dict(part="entry call", name=name, host_us=host_us(f, n=20000, warmup=200)) for name, f in entry_calls()]
    rows += [dict(part="empty step", name=name, host_us=host_us(f, n=20000, warmup=200)) for name, f in empty_steps()]
    steps, runs = whole_steps(args.rounds)
    rows += steps
    profile_diff(runs)
    if args.out:
        write_csv(args.out, rows, metadata())
    print_table(rows, ["part", "name", "host_us", "paired_seq_over_this", "forks"])


if __name__ == "__main__":
    main()
