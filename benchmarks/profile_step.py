"""Host cost of one eager training step, sequential vs erase (MLP proxy w256 b1024 bf16,
fused heads): wall time per step and a cProfile of each, to see what the ring adds.

    python benchmarks/profile_step.py
"""
import cProfile
import pstats
import time

import torch

from erase_triton import Scheduler
from erase_triton.models import MLPChain
from erase_triton.train import training_step


def main():
    torch.manual_seed(0)
    model = MLPChain(256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    y = torch.rand(1024, device="cuda").round().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = training_step(model, opt)
    for mode in ("sequential", "erase"):
        sched = Scheduler(mode)

        def run():
            with sched.step():
                step(x, y)
        for _ in range(10):
            run()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            run()
        host = (time.perf_counter() - t) / 100 * 1e3
        torch.cuda.synchronize()
        print(f"{mode}: {host:.3f} ms per eager step (host issue time)", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            run()
        pr.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(pr).sort_stats("tottime")
        st.print_stats(14)
        if mode == "erase":  # what the ring adds around each head
            st.print_callees("detach_point")


if __name__ == "__main__":
    main()
