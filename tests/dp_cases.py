"""Data-parallel cases shared by tests/test_distributed.py: each builds a model and one rank's
batch for a step. Run as a script, it is one rank of a gloo job (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment) that trains every case for STEPS steps and saves each step's
gradients and parameters to OUT_<rank>.pt."""
from __future__ import annotations

import sys

import torch

STEPS = 3
ROWS = 6  # rows a rank a step


def build(case: str):
    from erase_triton.models import CTRConfig, CTRModel, MLPChain, TinyTransformer

    torch.manual_seed(0)
    if case.startswith("mlp"):
        return MLPChain(12, blocks=3)
    if case.startswith("ctr"):
        return CTRModel(CTRConfig(n_dense=5, cardinalities=[40, 30, 20], emb_dim=4, width=16, depth=1,
                                  embedding="fused_sgd", embedding_lr=0.5))
    return TinyTransformer(vocab=32, width=16, layers=3, n_heads=2, max_seq=8)


def batch(case: str, step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if case.startswith("mlp"):
        return torch.randn(ROWS, 12, generator=g), torch.rand(ROWS, generator=g).round()
    if case.startswith("ctr"):
        return (torch.randn(ROWS, 5, generator=g), torch.stack([torch.randint(0, c, (ROWS,), generator=g)
                                                                 for c in (40, 30, 20)], 1),
                torch.rand(ROWS, generator=g).round())
    x = torch.randint(0, 32, (ROWS, 8), generator=g)
    return x, torch.randint(0, 32, (ROWS, 8), generator=g)


def union(case: str, step: int, world: int):
    parts = [batch(case, step, r) for r in range(world)]
    return tuple(torch.cat(ts) for ts in zip(*parts))


# name -> (mode, early updates)
CASES = {"mlp-e2e": ("e2e", False), "mlp-sequential": ("sequential", False), "mlp-erase": ("erase", False),
         "mlp-erase-early": ("erase", True), "ctr-erase-fused-sgd": ("erase", False),
         "ctr-sequential-early": ("sequential", True), "transformer-erase": ("erase", False)}


def train(case: str, inputs_of, dp: bool):
    """STEPS SGD(momentum) steps of `case`; returns [(grads, params)] after each step."""
    from erase_triton import Scheduler
    from erase_triton.distributed import data_parallel

    mode, early = CASES[case]
    model = build(case)
    if dp:
        data_parallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = Scheduler(mode, optimizer=opt if early else None)
    out = []
    for step in range(STEPS):
        with sched.step():
            opt.zero_grad(set_to_none=True)
            model(*inputs_of(step))
            if not early:
                opt.step()
        out.append(({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None},
                    {k: p.detach().clone() for k, p in model.named_parameters()}))
    return out


def refusals() -> dict:
    """What a rank sees for a whole-model DDP: the error messages (or 'no error')."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from erase_triton import Scheduler
    from erase_triton.distributed import data_parallel

    found = {}
    ddp = DDP(build("mlp"))
    try:
        with Scheduler("erase").step():
            ddp(*batch("mlp", 0, 0))
        found["ddp_forward"] = "no error"
    except RuntimeError as e:
        found["ddp_forward"] = str(e)
    try:
        data_parallel(ddp)
        found["ddp_wrap"] = "no error"
    except ValueError as e:
        found["ddp_wrap"] = str(e)
    return found


def main():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    result = {case: train(case, lambda s, c=case: batch(c, s, rank), dp=True) for case in CASES}
    result["refusals"] = refusals()
    torch.save(result, f"{sys.argv[1]}_{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
