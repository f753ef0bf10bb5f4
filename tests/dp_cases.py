"""Data-parallel cases shared by tests/test_distributed.py (gloo, CPU) and tests/test_gpu.py (NCCL; gloo
on CUDA): each builds a model and one rank's batch for a step. Run as a script, it is one rank of a job
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment; DP_DEVICE=cuda for a GPU a rank with NCCL,
which adds the captured cases; DP_BACKEND=gloo with DP_DEVICE=cuda for ranks that share the GPUs there)
that trains every case for STEPS steps and saves each step's gradients and parameters to OUT_<rank>.pt."""
from __future__ import annotations

import os
import sys

import torch

STEPS = 3
ROWS = 6  # rows a rank a step


def device() -> torch.device:
    if os.environ.get("DP_DEVICE") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    """The process group's backend: DP_BACKEND, else NCCL on CUDA and gloo on CPU."""
    return os.environ.get("DP_BACKEND") or ("nccl" if os.environ.get("DP_DEVICE") == "cuda" else "gloo")


def build(case: str):
    from erase_triton.models import CTRConfig, CTRModel, MLPChain, TinyTransformer

    torch.manual_seed(0)
    if case.startswith("mlp"):
        m = MLPChain(12, blocks=3)
    elif case.startswith("ctr"):
        m = CTRModel(CTRConfig(n_dense=5, cardinalities=[40, 30, 20], emb_dim=4, width=16, depth=1,
                               embedding="fused_sgd", embedding_lr=0.5))
    else:
        m = TinyTransformer(vocab=32, width=16, layers=3, n_heads=2, max_seq=8)
    if device().type == "cuda":
        for hd in m.modules():  # fixed-order sums: ranks and the union batch then differ by rounding only
            if hasattr(hd, "beside_config"):
                hd.config = hd.beside_config = __import__("erase_triton").LaunchConfig(deterministic=True)
    return m.to(device())


def batch(case: str, step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if case.startswith("mlp"):
        b = torch.randn(ROWS, 12, generator=g), torch.rand(ROWS, generator=g).round()
    elif case.startswith("ctr"):
        b = (torch.randn(ROWS, 5, generator=g), torch.stack([torch.randint(0, c, (ROWS,), generator=g)
                                                              for c in (40, 30, 20)], 1),
             torch.rand(ROWS, generator=g).round())
    else:
        b = torch.randint(0, 32, (ROWS, 8), generator=g), torch.randint(0, 32, (ROWS, 8), generator=g)
    return tuple(t.to(device()) for t in b)


def union(case: str, step: int, world: int):
    parts = [batch(case, step, r) for r in range(world)]
    return tuple(torch.cat(ts) for ts in zip(*parts))


# name -> (mode, early updates, captured)
CASES = {"mlp-e2e": ("e2e", False, False), "mlp-sequential": ("sequential", False, False),
         "mlp-erase": ("erase", False, False), "mlp-erase-early": ("erase", True, False),
         "ctr-erase-fused-sgd": ("erase", False, False), "ctr-sequential-early": ("sequential", True, False),
         "transformer-erase": ("erase", False, False), "mlp-erase-sharded": ("erase", False, False),
         "mlp-e2e-sharded": ("e2e", False, False), "transformer-sequential-sharded": ("sequential", False, False),
         "mlp-erase-early-sharded": ("erase", True, False)}
CAPTURED = {"mlp-erase-captured": ("erase", False, True), "mlp-erase-early-captured": ("erase", True, True),
            "mlp-e2e-captured": ("e2e", False, True), "ctr-erase-fused-sgd-captured": ("erase", False, True)}
WARMUP = 3  # Scheduler.capture's warm-up steps (they train, on the first batch)


def cases() -> dict:
    if device().type == "cpu":
        return CASES
    if backend() == "gloo":
        # gloo on CUDA: eager steps only (a gloo collective cannot be captured), and not FSDP's, whose
        # reduce-scatter gloo lacks on CUDA
        return {k: v for k, v in CASES.items() if "sharded" not in k}
    return {**CASES, **CAPTURED}


def train(case: str, inputs_of, dp: bool):
    """STEPS SGD(momentum) steps of `case`; returns [(grads, params)] after each step. A captured case
    trains WARMUP steps on batch 0 (capture's warm-up), then replays; the reference (dp=False, eager)
    runs the same sequence of batches."""
    from erase_triton import Scheduler
    from erase_triton.distributed import data_parallel, param_groups
    from erase_triton.train import training_step

    mode, early, captured = cases()[case]
    model = build(case)
    if dp:
        data_parallel(model, shard="sharded" in case)
    # foreach: CUDA's default everywhere (it cannot mix the sharded bodies' DTensors and the heads' tensors
    # in one group: param_groups keeps them apart)
    opt = torch.optim.SGD(param_groups(model), lr=0.05, momentum=0.9, foreach=True)
    sched = Scheduler(mode, optimizer=opt if early else None, adaptive=False)
    step_fn = training_step(model, opt, step_optimizer=not early)
    # FSDP's DTensors: full_tensor() is a collective, and at world size 1 it returns the local shard
    # itself, which the next optimizer step overwrites: clone
    full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()  # noqa: E731
    record = lambda: ({k: full(p.grad) for k, p in model.named_parameters() if p.grad is not None},  # noqa: E731
                      {k: full(p.detach()) for k, p in model.named_parameters()})
    out = []
    if captured and dp:
        static = [t.clone() for t in inputs_of(0)]
        replay = sched.capture(step_fn, *static, warmup=WARMUP)
        for step in range(STEPS):
            for s_, t in zip(static, inputs_of(step)):
                s_.copy_(t)
            replay()
            out.append(record())
        return out
    for step in ([0] * WARMUP if captured else []) + list(range(STEPS)):
        with sched.step():
            step_fn(*inputs_of(step))
        out.append(record())
    return out[-STEPS:]


def refusals() -> dict:
    """What a rank sees for a whole-model DDP and a whole-model fully_shard: the error messages of a
    step and of data_parallel (or 'no error')."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from erase_triton import Scheduler
    from erase_triton.distributed import data_parallel

    def error_of(fn, exc) -> str:
        try:
            fn()
            return "no error"
        except exc as e:
            return str(e)

    def step(model):
        with Scheduler("erase").step():
            model(*batch("mlp", 0, 0))
    ddp = DDP(build("mlp"), device_ids=[device().index] if device().type == "cuda" else None)
    whole = fully_shard(build("mlp"))  # one FSDP root over the whole chain
    return {"ddp_forward": error_of(lambda: step(ddp), RuntimeError),
            "ddp_wrap": error_of(lambda: data_parallel(ddp), ValueError),
            "fsdp_forward": error_of(lambda: step(whole), RuntimeError),
            "fsdp_wrap": error_of(lambda: data_parallel(whole), ValueError)}


def run_ranks(world: int, stem: str, cuda: bool = False, timeout: float = 240, backend: str | None = None) -> list:
    """Run this file as `world` ranks (gloo on CPU; on CUDA, NCCL with one GPU a rank, or with
    backend="gloo" ranks that share the GPUs, rank r on GPU r mod their count); returns each rank's results."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU: PyTorch heads
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    if cuda:
        env["DP_DEVICE"] = "cuda"
    if backend:
        env["DP_BACKEND"] = backend
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), stem],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    for p, e in zip(procs, errs):
        assert p.returncode == 0, e[-3000:]
    return [torch.load(f"{stem}_{r}.pt", map_location="cpu") for r in range(world)]


def compare(results: list, world: int, tol: float = 1e-5):
    """Every rank's gradients and parameters == the single-process run on the union batch, every step."""
    for case in cases():
        ref = train(case, lambda s, c=case: union(c, s, world), dp=False)
        for step, (grads, params) in enumerate(ref):
            for r in range(world):
                g_r, p_r = results[r][case][step]
                assert g_r.keys() == grads.keys(), (case, step, r)
                for k in grads:
                    torch.testing.assert_close(g_r[k], grads[k].cpu(), rtol=tol, atol=tol / 10,
                                               msg=f"{case} step {step} rank {r} grad {k}")
                for k in params:
                    torch.testing.assert_close(p_r[k], params[k].cpu(), rtol=tol, atol=tol / 10,
                                               msg=f"{case} step {step} rank {r} {k}")


def main():
    import torch.distributed as dist

    if os.environ.get("DP_DEVICE") == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend())
    rank = dist.get_rank()
    torch.set_num_threads(1)
    result = {case: train(case, lambda s, c=case: batch(c, s, rank), dp=True) for case in cases()}
    result["refusals"] = refusals()
    torch.save(result, f"{sys.argv[1]}_{rank}.pt")
    del result
    dist.barrier()  # every rank done with the group (FSDP's gathers above) before it goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
