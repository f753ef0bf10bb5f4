"""Training loops behind `erase-triton train`: CTR (MovieLens-100k or synthetic) and the byte LM."""
from __future__ import annotations

import json
import math
import resource
import time

import torch

from . import metrics
from .head import LocalHead
from .progress import progress as _progress
from .scheduler import Scheduler

CPU_DEFAULTS = {"ctr": dict(steps=400, batch_size=512), "transformer": dict(steps=300, batch_size=16)}
CUDA_DEFAULTS = {"ctr": dict(steps=3000, batch_size=1024), "transformer": dict(steps=2000, batch_size=32)}


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _make_opt(model, lr: float, dev, graph: bool):
    """Adam with a tensor learning rate, so a cosine schedule also reaches a captured step."""
    lr_t = torch.tensor(lr, device=dev) if graph else lr
    return torch.optim.Adam(model.parameters(), lr=lr_t, capturable=graph)


def _lr_factor(i: int, steps: int) -> float:
    """Cosine decay to 10% of the base learning rate."""
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i / max(steps, 1), 1.0)))


def _set_lr(opt, base: float, i: int, steps: int):
    v = base * _lr_factor(i, steps)
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(v)
        else:
            g["lr"] = v


def training_step(model, opt, step_optimizer: bool = True):
    """step(*inputs): zero grads, forward with LocalHeads (they back-propagate), optimizer step.
    Run it inside Scheduler.step() or give it to Scheduler.capture().
    step_optimizer=False: no opt.step() (a Scheduler(optimizer=opt) updates early itself)."""
    def step(*xs):
        opt.zero_grad(set_to_none=True)
        model(*xs)
        if step_optimizer:
            opt.step()
    return step


def _runner(model, opt, mode: str, graph: bool, static_inputs):
    """Returns run(inputs) doing one training step, eager or as a CUDA-graph replay."""
    sched = Scheduler(mode)
    step = training_step(model, opt)

    if not graph:
        def run(inputs):
            with sched.step():
                step(*inputs)
        return run
    replay = sched.capture(step, *static_inputs, warmup=3)

    def run(inputs):
        for s, x in zip(static_inputs, inputs):
            s.copy_(x, non_blocking=True)
        replay()
    return run


def _final_head(model) -> LocalHead:
    heads = [m for m in model.modules() if isinstance(m, LocalHead) and m.final]
    if not heads:
        raise ValueError("the model has no LocalHead(final=True): nothing to train end to end")
    return heads[-1]


def _loop(run, it, batch, opt, lr, steps, eval_every, progress, dev, evaluate, describe, on_lr=None, head=None):
    """Shared training loop: cosine LR, timed steps (evaluation excluded), periodic validation.
    on_lr(factor): also called each step with the schedule's factor (fused embedding SGD).
    head: the final LocalHead, whose loss is kept every step (a device copy, read at the end).
    Returns (train seconds, validation history, training loss per step)."""
    eval_every = eval_every or max(steps // 5, 1)
    bar = _progress(total=steps, desc="train", unit="step", disable=None if progress else True)
    train_time, history, losses = 0.0, [], []
    for i in range(1, steps + 1):
        t = time.perf_counter()
        _set_lr(opt, lr, i - 1, steps)
        if on_lr is not None:
            on_lr(_lr_factor(i - 1, steps))
        run(batch)
        if head is not None and head.last_loss is not None:
            losses.append(head.last_loss.detach().clone())  # no host sync: read after the loop
        batch = next(it)
        if dev.type == "cuda" and (i % eval_every == 0 or i == steps):
            torch.cuda.synchronize()
        train_time += time.perf_counter() - t
        bar.update(1)
        if i % eval_every == 0 or i == steps:
            v = evaluate()
            history.append({"step": i, **v})
            bar.set_postfix_str(describe(v))
    bar.close()
    train_loss = torch.stack(losses).float().cpu().tolist() if losses else []
    return train_time, history, train_loss


def _world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _reduced_rate(train_time: float, items: int, world: int, device) -> float:
    """Items a second over all ranks: every rank's items over the slowest rank's time."""
    if world == 1:
        return items / max(train_time, 1e-9)
    t = torch.tensor([train_time], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return items * world / max(float(t), 1e-9)


def _mean_over_ranks(values: list, world: int, device) -> list:
    if world == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float32, device=device)
    torch.distributed.all_reduce(t)
    return (t / world).cpu().tolist()


def _setup(kind: str, device, steps, batch_size, distributed: bool, seed: int):
    """(device, steps, batch_size, rank, world size) of a run: the device's defaults for `kind` where
    steps or batch_size is None, both checked; the global seed set."""
    dev = torch.device(device)
    d = (CUDA_DEFAULTS if dev.type == "cuda" else CPU_DEFAULTS)[kind]
    steps = d["steps"] if steps is None else steps
    batch_size = d["batch_size"] if batch_size is None else batch_size
    for name, v in (("steps", steps), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    rank, world = _world() if distributed else (0, 1)
    torch.manual_seed(seed)
    return dev, steps, batch_size, rank, world


def evaluate_ctr(model, data, batch: int = 8192) -> dict:
    model.eval()
    logits = torch.cat([model.predict(data.dense[i:i + batch], data.sparse[i:i + batch])
                        for i in range(0, len(data), batch)])
    model.train()
    return {"ne": metrics.normalized_entropy(logits, data.label).item(),
            "auc": metrics.auc(logits, data.label).item(),
            "logloss": metrics.log_loss(logits, data.label).item()}


def train_ctr(mode="erase", steps=None, batch_size=None, device="cpu", graph=False, seed=0, data="movielens",
              width=64, emb_dim=16, depth=1, lr=1e-3, eval_every=None, synthetic_rows=200_000,
              backend="auto", progress=True, embedding="table", embedding_lr=10.0, head_every=1,
              distributed=False) -> dict:
    """Adam on every parameter; with embedding="fused_sgd" the tables are updated by SGD
    (embedding_lr, same cosine schedule) inside the backward instead. head_every=k: a local
    head after every k-th of the six subarchitectures (CTRConfig.head_every).
    distributed=True (torch.distributed initialized, e.g. by torchrun): data-parallel over the
    default group; each rank trains on its shard of the training rows with batch_size rows a
    step, and throughput and training loss are reduced over the ranks."""
    from .data import batches, load_movielens, synthetic_criteo
    from .models.ctr import CTRConfig, CTRModel

    dev, steps, batch_size, rank, world = _setup("ctr", device, steps, batch_size, distributed, seed)
    if data == "movielens":
        tr, va, te = load_movielens()
    elif data == "synthetic":
        full = synthetic_criteo(synthetic_rows, cardinality=10_000, seed=seed)
        n = len(full)
        tr, va, te = full.slice(slice(0, int(.8 * n))), full.slice(slice(int(.8 * n), int(.9 * n))), \
            full.slice(slice(int(.9 * n), n))
    else:
        raise ValueError(f"data must be 'movielens' or 'synthetic', got {data!r}")
    tr, va, te = tr.to(dev), va.to(dev), te.to(dev)
    cfg = CTRConfig(n_dense=tr.dense.shape[1], cardinalities=tr.cardinalities, emb_dim=emb_dim, width=width,
                    depth=depth, backend=backend, embedding=embedding, embedding_lr=embedding_lr,
                    head_every=head_every)
    model = CTRModel(cfg).to(dev)
    if distributed:
        from .distributed import data_parallel, shard_of

        model = data_parallel(model)
        tr = tr.slice(shard_of(len(tr), rank, world))
    on_lr = (lambda f: model.embeddings.set_lr(embedding_lr * f)) if embedding == "fused_sgd" else None
    opt = _make_opt(model, lr, dev, graph)
    it = batches(tr, batch_size, torch.Generator().manual_seed(seed + rank))
    first = next(it)
    run = _runner(model, opt, mode, graph, [t.clone() for t in first])
    train_time, history, train_loss = _loop(
        run, it, first, opt, lr, steps, eval_every, progress, dev,
        lambda: {f"val_{k}": x for k, x in evaluate_ctr(model, va).items()},
        lambda v: f"val NE {v['val_ne']:.4f} AUC {v['val_auc']:.4f}", on_lr, head=_final_head(model))
    test = evaluate_ctr(model, te)
    return {"model": "ctr", "data": data, "embedding": embedding, "head_every": head_every, "mode": mode,
            "graph": graph, "device": str(dev), "seed": seed, "world_size": world,
            "steps": steps, "batch_size": batch_size, **test,
            "examples_per_s": _reduced_rate(train_time, steps * batch_size, world, dev),
            "train_loss": _mean_over_ranks(train_loss, world, dev),
            "peak_memory_mb": _peak_memory_mb(dev), "history": history}


@torch.no_grad()
def evaluate_lm(model, val: torch.Tensor, seq: int, device, max_windows: int = 256) -> float:
    model.eval()
    n = min((len(val) - 1) // seq, max_windows)
    x = val[: n * seq].long().view(n, seq).to(device)
    y = val[1: n * seq + 1].long().view(n, seq).to(device)
    losses = []
    for i in range(0, n, 64):
        logits = model.logits(x[i:i + 64]).float()
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i:i + 64].reshape(-1),
                                                        reduction="sum"))
    model.train()
    return math.exp((sum(losses) / (n * seq)).item())


def train_transformer(mode="erase", steps=None, batch_size=None, device="cpu", graph=False, seed=0, width=128,
                      seq=64, lr=1e-3, text="pydoc", eval_every=None, backend="auto", progress=True,
                      head_every: int = 1, distributed: bool = False) -> dict:
    """The six-layer byte LM (a CE head every `head_every` layers) trained in `mode`; returns
    the final validation perplexity (of the final head) and throughput. distributed: as
    `train_ctr` (each rank samples windows from its shard of the text)."""
    from .data.text import lm_batches, load_text
    from .models.transformer import TinyTransformer

    dev, steps, batch_size, rank, world = _setup("transformer", device, steps, batch_size, distributed, seed)
    tr, va = load_text(text)
    model = TinyTransformer(vocab=256, width=width, layers=6, n_heads=max(1, width // 64), max_seq=seq,
                            backend=backend, head_every=head_every).to(dev)
    if distributed:
        from .distributed import data_parallel, shard_of

        model = data_parallel(model)
        tr = tr[shard_of(len(tr), rank, world)]
    opt = _make_opt(model, lr, dev, graph)
    it = lm_batches(tr, batch_size, seq, torch.Generator().manual_seed(seed + rank), device=dev)
    first = next(it)
    run = _runner(model, opt, mode, graph, [t.clone() for t in first])
    train_time, history, train_loss = _loop(
        run, it, first, opt, lr, steps, eval_every, progress, dev,
        lambda: {"val_perplexity": evaluate_lm(model, va, seq, dev)},
        lambda v: f"val ppl {v['val_perplexity']:.2f}", head=_final_head(model))
    rate = _reduced_rate(train_time, steps * batch_size, world, dev)  # (one collective when distributed)
    return {"model": "transformer", "head_every": head_every, "data": text, "mode": mode, "graph": graph,
            "device": str(dev), "seed": seed, "world_size": world,
            "steps": steps, "batch_size": batch_size, "seq": seq, "perplexity": history[-1]["val_perplexity"],
            "examples_per_s": rate, "tokens_per_s": rate * seq, "peak_memory_mb": _peak_memory_mb(dev),
            "history": history, "train_loss": _mean_over_ranks(train_loss, world, dev)}


def write_json(result: dict, path: str | None):
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
