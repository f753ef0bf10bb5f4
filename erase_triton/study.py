"""The studies behind `erase-triton bench | sweep | trace`: speedup curves, occupancy
sweeps and execution traces. Results are CSV (with GPU and versions) + PNG plots.

Each study builds its models from `erase_triton.models`, runs every variant in one
process on one GPU, and times steps with CUDA events (graphed: replays of a captured
step; eager: the step as the host issues it).
"""
from __future__ import annotations

import csv
import functools
import json
import os
import platform
import random
import statistics
import time

import torch
import torch.nn.functional as F

from . import reference
from .blocks import compile_blocks
from .head import LocalHead
from .models.ctr import CTRConfig, CTRModel
from .models.mlp import MLPChain
from .models.transformer import TinyTransformer
from .reference import head_loss, linear_head_loss
from .scheduler import Scheduler
from .train import training_step

OCCUPANCIES = [1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0]


# ---------------------------------------------------------------------------- helpers
def metadata() -> dict:
    import triton

    m = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
         "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, sms=p.multi_processor_count)
    else:
        m.update(gpu="none (CPU)")
    return m


def write_csv(path: str, rows: list[dict], meta: dict | None = None):
    """CSV with the GPU and versions on every row (a file stands alone), plus <stem>.meta.json."""
    meta = meta or metadata()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(os.path.splitext(path)[0] + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + ["gpu", "torch", "triton"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "gpu": meta.get("gpu"), "torch": meta.get("torch"), "triton": meta.get("triton")})


def read_csv(path: str) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def median_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median per-call time: CUDA events around each call (host clock without CUDA)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


# --------------------------------------------------------------------------- workloads
CTR_EMBEDDING = "fused_sgd"


def ctr_workload(width: int, batch: int, *, tables: int = 26, rows: int = 100_000, emb_dim: int = 64,
                 occupancy="auto", backend="auto", device="cuda", seed=0, embedding=CTR_EMBEDDING,
                 head_every: int = 1):
    """The DLRM-like proxy of DESIGN.md: 26 tables of rows x emb_dim, 13 dense features,
    six dense subarchitectures of `width` with local BCE heads (after every `head_every`-th
    one), and the final head.
    embedding: "fused_sgd" (default; SGD fused into the embedding backward, as production
    CTR trainers run their tables) or "table" (26 nn.Embedding with dense gradients)."""
    torch.manual_seed(seed)
    cfg = CTRConfig(n_dense=13, cardinalities=[rows] * tables, emb_dim=emb_dim, width=width, depth=2,
                    occupancy=occupancy, backend=backend, embedding=embedding, embedding_lr=1e-3,
                    head_every=head_every)
    with torch.device(device):  # initialise the 166M embedding entries where they live
        model = CTRModel(cfg)
    g = torch.Generator(device="cpu").manual_seed(seed)
    dense = torch.randn(batch, 13, generator=g).to(device)
    sparse = torch.randint(0, rows, (batch, tables), generator=g).to(device)
    label = torch.rand(batch, generator=g).round().to(device)
    return model, (dense, sparse, label)


def transformer_workload(width: int, batch: int, seq: int, *, occupancy="auto", backend="auto", device="cuda",
                         dtype=torch.bfloat16, seed=0, head_every: int = 1):
    """The six-layer transformer (a CE head every `head_every` layers) and one batch of tokens."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=256, width=width, layers=6, n_heads=max(1, width // 64), max_seq=seq,
                            backend=backend, occupancy=occupancy, head_every=head_every).to(device, dtype)
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randint(0, 256, (batch, seq), generator=g).to(device)
    y = torch.randint(0, 256, (batch, seq), generator=g).to(device)
    return model, (x, y)


def mlp_workload(width: int, batch: int, dtype=torch.bfloat16, *, occupancy="auto", backend="auto", device="cuda",
                 seed=0, relu_in_head=False):
    """The six-block MLP proxy (BCE heads) and one batch of random inputs and 0/1 targets.
    relu_in_head: each block's last ReLU is applied by its head (MLPChain(relu_in_head=True))."""
    torch.manual_seed(seed)
    model = MLPChain(width, backend=backend, occupancy=occupancy, device=device, dtype=dtype,
                     relu_in_head=relu_in_head)
    x = torch.randn(batch, width, device=device, dtype=dtype)
    y = torch.rand(batch, device=device).round().to(dtype)
    return model, (x, y)


def e2e_loss_fn(model):
    """Plain end-to-end loss of a model (no LocalHead machinery): what torch.compile gets."""
    if isinstance(model, CTRModel):
        def fn(dense, sparse, label):
            h = model.features(dense, sparse)
            for sub in model.subarchs:
                h = sub(h)
            z = model.final_head.logits(model.over(h)).squeeze(-1)
            return F.binary_cross_entropy_with_logits(z.float(), label.float())
    else:
        def fn(x, y):
            h = model.embed(x)
            for layer in model.layers:
                h = layer(h)
            z = model.heads[-1].logits(model.ln_f(h))
            return head_loss(z.reshape(-1, z.shape[-1]).float(), y.reshape(-1), "ce", "mean", -100)
    return fn


def _step_runner(sched, step_fn, inputs, graphed: bool):
    """run() doing one step: a replay of the captured step (capture() warms up), or the
    step issued eagerly inside sched.step() after three warm-up steps."""
    if graphed:
        return sched.capture(step_fn, *inputs, warmup=3)

    def run():
        with sched.step():
            step_fn(*inputs)
    for _ in range(3):
        run()
    return run


class FreeHead(LocalHead):
    """The bound on what any head implementation can buy: a head that costs nothing. It
    back-propagates a stored gradient into its block (no logits, no loss, no head grads), so a
    step with FreeHeads is the step's time with the heads' work removed. With
    activation="relu" its gradient goes to the ReLU's input, as the fused head's does, and it
    returns relu(h) from its own launch (queued before the backward, as session 11's bound had it).

    free_grad: "constant" (1e-4 everywhere: the bound of sessions 9-12) or "replayed" (the
    gradient a real head computed on the first call, with PyTorch, reused on every later call).
    The block's backward GEMMs then multiply the same kind of data as with a real head: a
    constant feeds them few bit toggles, and a matrix unit on low-toggle data draws less power
    and can run faster (METHOD.md: a bf16 product 13% faster on zeros than on random data), so
    the constant bound can overstate what removing the heads buys where the step is GEMM-bound."""

    free_grad = "constant"

    def apply_loss(self, h, target, beside=False, act=None):
        out = act if act is not None else self.act(h.detach())
        g = getattr(self, "_free_grad", None)
        if g is None or g.shape != h.shape or g.dtype != h.dtype:
            if self.free_grad == "replayed":
                g = reference.local_head(h.detach(), self.weight, self.bias, target, loss=self.loss,
                                         reduction=self.reduction, ignore_index=self.ignore_index,
                                         activation=self.activation).grad_h
            else:
                g = torch.full_like(h, 1e-4)
            self._free_grad = g
        if h.requires_grad:
            torch.autograd.backward(h, g)
        return out


class StreamHead(LocalHead):
    """A bound between zero-cost and fused heads (C=1 BCE/MSE heads only): its launch moves the
    fused dense kernel's bytes (reads h, writes grad_h and, with activation="relu" and nothing
    beside it, relu(h)) on the same tiles, grid and occupancy, and back-propagates the real
    head gradient, but replays the first call's dz (PyTorch) instead of computing the logits,
    the loss and the head's grads (`erase_triton.kernels.stream_head`). Fused against stream
    heads is what the kernel's compute structure costs a step; stream against zero-cost heads
    (`FreeHead`) what the I/O every correct head does costs, at this tiling and occupancy."""

    def apply_loss(self, h, target, beside=False, act=None):
        from erase_triton.kernels.stream_head import stream_head

        if self.out_features != 1 or self.loss == "ce":
            raise ValueError(f"StreamHead needs a C=1 'bce' or 'mse' head, got loss={self.loss!r} "
                             f"out_features={self.out_features}")
        hd = h.detach() if act is None else act
        h2 = hd.reshape(-1, self.in_features)
        dz = getattr(self, "_dz", None)
        if dz is None or dz.shape[0] != h2.shape[0]:
            z = self.logits(self.act(h2)).detach().requires_grad_(True)
            loss = head_loss(z, target.reshape(-1, 1), self.loss, self.reduction, self.ignore_index)
            dz = self._dz = torch.autograd.grad(loss, z)[0].reshape(-1).float().contiguous()
        out = hd
        if act is None and self.activation is not None:
            out = torch.empty_like(hd, memory_format=torch.contiguous_format)
        grad_h = stream_head(h2, dz, self.weight.detach(), relu=self.activation == "relu",
                             act_out=None if out is hd else out.view(h2.shape), config=self.launch_config(hd, beside))
        if h.requires_grad:
            torch.autograd.backward(h, grad_h.view(h.shape))
        return out


def _swap_heads(model, cls, cached: str | None = None, **attrs):
    """Make every LocalHead of `model` a `cls` (in place), with attrs set and the cached replay
    state (`cached`, if any) dropped; returns the model."""
    for m in model.modules():
        if isinstance(m, LocalHead):
            m.__class__ = cls
            m.__dict__.update(attrs)
            if cached:
                m.__dict__.pop(cached, None)
    return model


def stream_heads(model):
    """Make every LocalHead of `model` a StreamHead (in place); returns the model."""
    return _swap_heads(model, StreamHead, "_dz")


def free_heads(model, free_grad: str = "constant"):
    """Make every LocalHead of `model` a FreeHead (in place) with the given free_grad; returns the model."""
    if free_grad not in ("constant", "replayed"):
        raise ValueError(f"free_grad must be 'constant' or 'replayed', got {free_grad!r}")
    return _swap_heads(model, FreeHead, "_free_grad", free_grad=free_grad)


@functools.cache
def _compiled_torch_head_loss():
    return torch.compile(linear_head_loss, dynamic=False)


class CompiledTorchHead(LocalHead):
    """The strongest PyTorch head a user would write: the head's logits and loss under
    torch.compile (Inductor fuses the bias, the loss and the loss's backward around the GEMMs;
    the GEMMs stay cuBLAS), then one backward() through head and block, as a PyTorch head does.
    Build it with backend="torch" (`with_heads(..., "torch-compile")`): it is LocalHead's PyTorch
    path with `linear_head_loss` compiled, and a ReLU head's activation runs before it as for
    PyTorch heads. Graphs are shared by all such heads in the process: call torch._dynamo.reset()
    between models of other shapes (recompile_limit)."""

    @property
    def _torch_loss(self):
        return _compiled_torch_head_loss()


HEADS = ("fused", "torch", "torch-compile", "free", "free-replayed", "stream")


def with_heads(workload, heads: str, *args, **kw):
    """workload(*args, **kw) (e.g. `mlp_workload`) with fused ("fused"), PyTorch ("torch"),
    compiled PyTorch heads ("torch-compile": `CompiledTorchHead`), zero-cost heads (`FreeHead`: "free" back-propagates a constant, "free-replayed" the first
    step's real head gradient) or stream heads ("stream": `StreamHead`, the fused kernel's bytes
    without its math); returns (model, inputs)."""
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, got {heads!r}")
    model, inputs = workload(*args, backend="torch" if heads.startswith("torch") else "auto", **kw)
    if heads == "torch-compile":
        _swap_heads(model, CompiledTorchHead)
    elif heads.startswith("free"):
        free_heads(model, "replayed" if heads == "free-replayed" else "constant")
    elif heads == "stream":
        stream_heads(model)
    return model, inputs


def time_step(model, inputs, mode: str, graphed: bool, streams=None, lr: float = 1e-3,
              priorities: bool | str | None = None, compiled: bool = False, early_update: bool = False,
              optimizer=None) -> dict:
    """Median step time (ms) of one mode; eager runs also report peak memory.
    priorities: Scheduler(priorities=...) of the erase ring; None: the Scheduler's default.
    compiled: torch.compile the blocks between the heads first (`compile_blocks`, Inductor).
    early_update: the scheduler steps the optimizer itself, each segment's parameters after its
    backward (Scheduler(optimizer=)); otherwise opt.step() after the step.
    optimizer: params -> torch.optim.Optimizer (default: SGD at lr)."""
    if compiled:
        compile_blocks(model)
    opt = optimizer(model.parameters()) if optimizer is not None else torch.optim.SGD(model.parameters(), lr=lr)
    kw = {} if priorities is None else dict(priorities=priorities)
    sched = Scheduler(mode, streams=streams, optimizer=opt if early_update else None, **kw)
    step = training_step(model, opt, step_optimizer=not early_update)

    out = {}
    run = _step_runner(sched, step, inputs, graphed)
    if graphed:
        out["ms"] = median_ms(run, 30, 5)
        del run
    else:
        if torch.cuda.is_available():
            out["peak_mb"] = _peak_mb(run)
        out["ms"] = median_ms(run, 20, 3)
    return out


def _peak_mb(run) -> float:
    """Peak device memory (MB) that one call of run() allocates above what was live before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def time_eager_modes(model, inputs, variants, iters: int = 40, lr: float = 1e-3, rounds: dict | None = None,
                     wall_steps: int = 0, wall: dict | None = None) -> dict:
    """Eager steps of several schedules, interleaved on one model (every round runs each
    variant once, in a shuffled order: A C B, B A C, ...).

    variants: {name: Scheduler}. An eager step is host-bound at small sizes, and the
    host's speed drifts over seconds, so modes timed one after another differ by more
    than the modes themselves; interleaving gives each the same drift, and shuffling
    each round removes a bias from the position in it. Returns
    {name: (median ms from CUDA events, peak MB of one step, median host ms to issue
    one step)}; host ms close to the event ms means the step is host-bound. rounds, if
    given, is filled with {name: [ms of each round]}, in round order: a ratio of two
    variants' times in the same round cancels drift slower than one round (a paired estimate).

    wall_steps=K > 0: after the event rounds, `iters` more rounds in which each variant runs K
    consecutive steps between two device syncs, timed by the host clock; `wall` is filled with
    {name: [ms a step of each round]}. That is a run's throughput: events time the GPU's share of a
    step, which in a host-bound step is not what a run of such steps takes (the host issues the
    next step no sooner). Each block starts on an idle GPU and ends with a drain, ~1/K of a lone
    step's extra time a step; that extra differs by variant (session 22, w2048: ~1.6 ms for
    sequential, ~0.35 ms for erase), so a small K leans slightly (~1% at K=10) towards erase.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    step = training_step(model, opt)
    runs = {name: _step_runner(sched, step, inputs, False) for name, sched in variants.items()}
    cuda = torch.cuda.is_available()
    peak = {name: _peak_mb(run) if cuda else float("nan") for name, run in runs.items()}
    ev = {name: [] for name in runs}
    host = {name: [] for name in runs}
    order, rng = list(runs), random.Random(0)
    for _ in range(iters):
        rng.shuffle(order)
        for name in order:
            run = runs[name]
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t = time.perf_counter()
            run()
            host[name].append((time.perf_counter() - t) * 1e3)
            if cuda:
                b.record()
                ev[name].append((a, b))
    if cuda:
        torch.cuda.synchronize()
        per_round = {name: [a.elapsed_time(b) for a, b in ev[name]] for name in runs}
    else:  # no device clock: the host's
        per_round = host
    ms = {name: statistics.median(per_round[name]) for name in runs}
    if rounds is not None:
        rounds.update(per_round)
    if wall_steps > 0:
        per_wall = {name: [] for name in runs}
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for _ in range(iters):
            rng.shuffle(order)
            for name in order:
                run = runs[name]
                sync()
                t = time.perf_counter()
                for _ in range(wall_steps):
                    run()
                sync()
                per_wall[name].append((time.perf_counter() - t) * 1e3 / wall_steps)
        if wall is not None:
            wall.update(per_wall)
    return {name: (ms[name], peak[name], statistics.median(host[name])) for name in runs}


def time_compiled_e2e(model, inputs, lr: float = 1e-3, graphed: bool = False) -> dict:
    """torch.compile of the plain e2e step (forward + loss compiled; backward via AOTAutograd).
    graphed: the whole step (compiled forward and backward, optimizer step) captured in one CUDA
    graph after the compiling warm-up steps, as graphed e2e is: the host then issues nothing."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = torch.compile(e2e_loss_fn(model))

    def step(*xs):
        opt.zero_grad(set_to_none=True)
        loss_fn(*xs).backward()
        opt.step()
    run = _step_runner(Scheduler("e2e"), step, inputs, graphed)
    return {"ms": median_ms(run, 30, 5) if graphed else median_ms(run, 20, 5)}


def _tf32_metadata() -> dict:
    """fp32 matmuls in TF32 (what a user on Hopper runs) for bench and sweep; recorded in the metadata."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    meta = metadata()
    meta["fp32_matmul"] = "tf32" if cuda else "ieee"
    return meta


# ------------------------------------------------------------------------------- bench
BENCH_CTR = [(256, 2048), (256, 8192), (512, 4096), (512, 16384), (1024, 4096), (1024, 16384), (2048, 16384),
             (2048, 32768), (4096, 16384)]
BENCH_TF = [(256, 32, 128), (512, 32, 128), (512, 32, 256), (1024, 32, 256), (2048, 16, 256)]
COMPILE_AT = {("ctr", 512, 4096), ("ctr", 1024, 16384), ("ctr", 2048, 16384), ("transformer", 256, 32),
              ("transformer", 512, 32), ("transformer", 1024, 32), ("transformer", 2048, 16)}
# ^ the torch.compile rows (`compile_rows`) are timed here: each costs compiles


def bench_cases(quick: bool = False, models=("ctr", "transformer"), embedding: str = CTR_EMBEDDING,
                head_every: int = 1) -> list:
    """The speedup study's sizes as (model name, size dict, build() -> (model, inputs)); on a
    CPU one small size a model. head_every=k: both models with a local head after every k-th
    of their six blocks (size dicts then carry head_every)."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    ctr = [(128, 512)] if not cuda else (BENCH_CTR[2:4] if quick else BENCH_CTR)
    tf = [(64, 4, 32)] if not cuda else (BENCH_TF[:2] if quick else BENCH_TF)
    k = {} if head_every == 1 else dict(head_every=head_every)
    cases = [("ctr", dict(width=w, batch=b, embedding=embedding, **k),
              lambda w=w, b=b: ctr_workload(w, b, device=dev, rows=100_000 if cuda else 1000, embedding=embedding,
                                            head_every=head_every))
             for w, b in ctr if "ctr" in models]
    cases += [("transformer", dict(width=w, batch=b, seq=s, **k),
               lambda w=w, b=b, s=s: transformer_workload(w, b, s, device=dev, dtype=torch.bfloat16 if cuda else torch.float32,
                                                          head_every=head_every))
              for w, b, s in tf if "transformer" in models]
    return cases


def compile_rows(name: str, desc: dict, build, log=print, modes=("e2e", "sequential", "erase"),
                 early_update: bool = False) -> list[dict]:
    """torch.compile rows of one size. e2e: the plain e2e step compiled whole, loss included
    (`time_compiled_e2e`), with the host issuing every kernel (exec "compile") and captured in
    one CUDA graph ("compile+graph": the strongest e2e baseline). sequential / erase: the blocks
    between the heads compiled (`compile_blocks`), the fused heads as they are, the whole step in
    one CUDA graph ("compile+graph"). early_update: also erase with early updates (the scheduler
    steps each segment's SGD after its backward; column early_update=1). A row that fails to
    compile or capture keeps its error, not a lost study."""
    runs = []
    if "e2e" in modes:
        runs += [("compile", "e2e", False, lambda m, x: time_compiled_e2e(m, x)),
                 ("compile+graph", "e2e", False, lambda m, x: time_compiled_e2e(m, x, graphed=True))]
    runs += [("compile+graph", mode, False, lambda m, x, mode=mode: time_step(m, x, mode, True, compiled=True))
             for mode in ("sequential", "erase") if mode in modes]
    if early_update:
        runs.append(("compile+graph", "erase", True,
                     lambda m, x: time_step(m, x, "erase", True, compiled=True, early_update=True)))
    rows = []
    for exec_, mode, early, timed in runs:
        model, inputs = build()
        tag = dict(early_update=1) if early else {}
        try:
            r = dict(model=name, **desc, exec=exec_, mode=mode, **tag, **timed(model, inputs))
        except Exception as e:  # noqa: BLE001 -- see the docstring
            r = dict(model=name, **desc, exec=exec_, mode=mode, **tag, error=repr(e)[:200])
        rows.append(r)
        log(r)
        del model, inputs
        torch._dynamo.reset()
    return rows


def bench(out_dir: str, quick: bool = False, compile_baseline: bool = True, models=("ctr", "transformer"),
          eager: bool = False, embedding: str = CTR_EMBEDDING, log=print) -> list[dict]:
    """Speedup curves: erase (fused heads) vs sequential vs e2e vs torch.compile(e2e).

    Graphed steps (the regime the scheduler is for); `eager` adds eager steps. fp32
    matmuls run in TF32, as a CTR user on Hopper runs them (recorded in the CSV metadata).
    embedding: the CTR proxy's tables ("fused_sgd" or "table", see `ctr_workload`).
    """
    cuda = torch.cuda.is_available()
    meta = _tf32_metadata()
    rows = []
    for name, desc, build in bench_cases(quick, models, embedding):
        for graphed in ([True] + ([False] if eager else []) if cuda else [False]):
            for mode in ("e2e", "sequential", "erase"):
                model, inputs = build()
                r = dict(model=name, **desc, exec="graph" if graphed else "eager", mode=mode, **time_step(model, inputs, mode, graphed))
                rows.append(r)
                log(r)
        if compile_baseline and cuda and (name, desc["width"], desc["batch"]) in COMPILE_AT:
            rows += compile_rows(name, desc, build, log)
        if cuda:
            torch.cuda.empty_cache()
        write_csv(os.path.join(out_dir, "bench.csv"), rows, meta)
    return rows


# ------------------------------------------------------------------------------- sweep
def sweep(out_dir: str, quick: bool = False, log=print) -> list[dict]:
    """Step time against the heads' SM fraction (and ring size), per model and size.
    fp32 matmuls in TF32, like `bench`."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    meta = _tf32_metadata()
    occs = OCCUPANCIES
    if cuda:
        cases = [("ctr", dict(width=256, batch=8192), lambda o: ctr_workload(256, 8192, occupancy=o)),
                 ("ctr", dict(width=1024, batch=16384), lambda o: ctr_workload(1024, 16384, occupancy=o)),
                 ("transformer", dict(width=256, batch=32, seq=128), lambda o: transformer_workload(256, 32, 128, occupancy=o)),
                 ("transformer", dict(width=1024, batch=32, seq=256), lambda o: transformer_workload(1024, 32, 256, occupancy=o))]
        if quick:  # one small size per model, every occupancy
            cases = [("ctr", dict(width=512, batch=4096), lambda o: ctr_workload(512, 4096, occupancy=o)), cases[2]]
    else:
        cases = [("ctr", dict(width=64, batch=256), lambda o: ctr_workload(64, 256, rows=1000, occupancy=o, device=dev))]
    rows = []
    for name, desc, build in cases:
        for occ in occs:
            for graphed, streams in ([(True, None), (True, 2), (False, None)] if cuda else [(False, None)]):
                model, inputs = build(occ)
                r = dict(model=name, **desc, occupancy=occ, streams=streams or "per-segment",
                         exec="graph" if graphed else "eager", **time_step(model, inputs, "erase", graphed, streams))
                rows.append(r)
                log(r)
        write_csv(os.path.join(out_dir, "sweep.csv"), rows, meta)
    return rows


# ------------------------------------------------------------------------------- trace
def _kernel_intervals(prof, graphed: bool = False) -> list[dict]:
    """(stream, start, end, name, phase) of every kernel; the phase comes from the
    erase::* range (on the host) that was open when the kernel was launched. A graph
    replay launches every kernel at once, so there only head kernels are told apart."""
    evs = list(prof.profiler.kineto_results.events())
    ranges, launches, kernels = [], {}, []
    for e in evs:
        name = e.name()
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            kernels.append(e)
        elif name.startswith("erase::"):
            ranges.append((e.start_ns(), e.start_ns() + e.duration_ns(), name.split("::")[1].split(" ")[0]))
        elif "LaunchKernel" in name or "cudaGraphLaunch" in name or "cuLaunch" in name:
            launches[e.correlation_id()] = e.start_ns()
    out = []
    for k in kernels:
        t = launches.get(k.correlation_id())
        phase = "fwd/bwd (graph)" if graphed else "forward"
        if "head_kernel" in k.name() or "_ce_kernel" in k.name():
            phase = "head"
        elif t is not None and not graphed:
            inner = [r for r in ranges if r[0] <= t <= r[1]]
            if inner:
                phase = min(inner, key=lambda r: r[1] - r[0])[2]
        out.append(dict(stream=k.device_resource_id(), start=k.start_ns(), end=k.start_ns() + k.duration_ns(),
                        name=k.name(), phase=phase))
    t0 = min((k["start"] for k in out), default=0)
    for k in out:
        k["start"] = (k["start"] - t0) / 1e3
        k["end"] = (k["end"] - t0) / 1e3
    return out


def trace(out_dir: str, steps: int = 3, log=print, execs=("graph", "eager"), only: str | None = None) -> list[dict]:
    """Chrome traces + timeline PNGs of erase steps, replayed from a CUDA graph and issued
    eagerly: the small transformer (overlap), a saturating MLP (nothing to overlap), and the
    w512 b4096 MLP with fused and with PyTorch heads (bf16, tf32) and with zero-cost heads (tf32;
    tf32 dots on), and the tf32 one with the blocks' last ReLU in the heads ("_relu_in_head"); the
    w512 b1024 tf32 MLP (ReLU in the heads) and the transformer w512 b32 s256 with fused, PyTorch and
    zero-cost heads, and with its blocks compiled (`compile_blocks`).
    only: keep the configs whose name contains it. Returns per-config overlap summaries."""
    from .plots import plot_timeline

    if not torch.cuda.is_available():
        raise RuntimeError("trace needs a CUDA device (kernel timelines come from CUPTI)")
    meta = _tf32_metadata()  # the tf32 configs (fp32 weights) as bench_schedule runs them
    os.makedirs(out_dir, exist_ok=True)
    configs = [("transformer_w256_b32_s128", lambda: transformer_workload(256, 32, 128)),
               ("transformer_w1024_b32_s256", lambda: transformer_workload(1024, 32, 256)),
               ("mlp_w4096_b32768_saturating", lambda: mlp_workload(4096, 32768))]
    # the sizes where the fused heads gain least (bench_schedule, graphed): fused, PyTorch and zero-cost heads
    for dname, heads, relu in (("bf16", "fused", False), ("bf16", "torch", False), ("tf32", "fused", False),
                               ("tf32", "torch", False), ("tf32", "free", False), ("tf32", "fused", True),
                               ("tf32", "torch", True)):
        configs.append((f"mlp_w512_b4096_{dname}_{heads}_heads" + ("_relu_in_head" if relu else ""),
                        lambda dname=dname, heads=heads, relu=relu: with_heads(
                            mlp_workload, heads, 512, 4096, torch.bfloat16 if dname == "bf16" else torch.float32,
                            relu_in_head=relu)))
    # fused, PyTorch and zero-cost heads: the w512 b1024 tf32 MLP with the ReLU in the heads (latency-bound, fused
    # heads 1.11x PyTorch heads, bound 1.16) and the transformer w512 b32 s256
    for name, workload, args, kw in (("mlp_w512_b1024_tf32_{}_heads_relu_in_head", mlp_workload,
                                      (512, 1024, torch.float32), dict(relu_in_head=True)),
                                     ("transformer_w512_b32_s256_{}_heads", transformer_workload, (512, 32, 256), {})):
        for heads in ("fused", "torch", "free"):
            configs.append((name.format(heads), lambda w=workload, h=heads, a=args, k=kw: with_heads(w, h, *a, **k)))
    # the transformer with its blocks compiled (compile_blocks): Inductor's kernels on the segments' streams
    configs.append(("transformer_w512_b32_s256_compiled_blocks",
                    lambda: _compiled_blocks(*transformer_workload(512, 32, 256))))
    configs = [c for c in configs if only is None or only in c[0]]
    summary = []
    for (cfg, build), ex in [(c, e) for c in configs for e in execs]:
        name = f"{cfg}_{ex}"
        model, inputs = build()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        sched = Scheduler("erase")

        def step_fn(*xs):
            opt.zero_grad(set_to_none=True)
            model(*xs)
            with torch.profiler.record_function("erase::optimizer"):
                opt.step()
        run = _step_runner(sched, step_fn, inputs, ex == "graph")
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run()
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(out_dir, f"trace_{name}.json"))
        ks = _kernel_intervals(prof, graphed=ex == "graph")
        busy = _union([(k["start"], k["end"]) for k in ks])
        total = sum(k["end"] - k["start"] for k in ks)
        s = dict(config=cfg, exec=ex, kernels=len(ks), streams=len({k["stream"] for k in ks}), span_us=max(k["end"] for k in ks),
                 busy_us=busy, kernel_sum_us=total, concurrency=total / max(busy, 1e-9))
        summary.append(s)
        log(s)
        plot_timeline(ks, os.path.join(out_dir, f"timeline_{name}.png"), title=f"{cfg}: {steps} {ex} erase steps "
                      f"(kernel time / busy time = {s['concurrency']:.2f})")
        with open(os.path.join(out_dir, f"kernels_{name}.json"), "w") as f:
            json.dump(ks, f)
        del run, model, inputs, opt, sched, prof
        torch.cuda.empty_cache()
    write_csv(os.path.join(out_dir, "trace_summary.csv"), summary, meta)
    return summary


def _compiled_blocks(model, inputs):
    compile_blocks(model)
    return model, inputs


def _union(iv):
    tot, end = 0.0, float("-inf")
    for s, e in sorted(iv):
        if s > end:
            tot += e - s
            end = e
        elif e > end:
            tot += e - end
            end = e
    return tot
