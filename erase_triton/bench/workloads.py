"""The benchmark models: the CTR proxy, the six-layer transformer and the six-block MLP, each
with one batch of inputs, plus the plain end-to-end loss torch.compile gets and the speedup
study's sizes."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.ctr import CTRConfig, CTRModel
from ..models.mlp import MLPChain
from ..models.transformer import TinyTransformer
from .heads import set_vocab_path
from ..reference import head_loss

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
                         dtype=torch.bfloat16, seed=0, head_every: int = 1, vocab: int = 256, vocab_path=None):
    """The six-layer transformer (a CE head every `head_every` layers) and one batch of tokens.
    vocab: the heads' classes (256: bytes; a larger one takes the vocabulary CE kernels, whose path
    `vocab_path` picks: `set_vocab_path`)."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=vocab, width=width, layers=6, n_heads=max(1, width // 64), max_seq=seq,
                            backend=backend, occupancy=occupancy, head_every=head_every).to(device, dtype)
    if vocab_path is not None:
        set_vocab_path(model, vocab_path)
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    y = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
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


BENCH_CTR = [(256, 2048), (256, 8192), (512, 4096), (512, 16384), (1024, 4096), (1024, 16384), (2048, 16384),
             (2048, 32768), (4096, 16384)]
BENCH_TF = [(256, 32, 128), (512, 32, 128), (512, 32, 256), (1024, 32, 256), (2048, 16, 256)]
COMPILE_AT = {("ctr", 512, 4096), ("ctr", 1024, 16384), ("ctr", 2048, 16384), ("transformer", 256, 32),
              ("transformer", 512, 32), ("transformer", 1024, 32), ("transformer", 2048, 16)}
# ^ the torch.compile rows (`compile_rows`) are timed here: each costs compiles


def bench_cases(quick: bool = False, models=("ctr", "transformer"), embedding: str = CTR_EMBEDDING,
                head_every: int = 1, vocab: int = 256, vocab_path=None) -> list:
    """The speedup study's sizes as (model name, size dict, build() -> (model, inputs)); on a
    CPU one small size a model. head_every=k: both models with a local head after every k-th
    of their six blocks (size dicts then carry head_every). vocab, vocab_path: the transformer's
    (`transformer_workload`; size dicts carry them where they differ from 256 and None)."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    ctr = [(128, 512)] if not cuda else (BENCH_CTR[2:4] if quick else BENCH_CTR)
    tf = [(64, 4, 32)] if not cuda else (BENCH_TF[:2] if quick else BENCH_TF)
    k = {} if head_every == 1 else dict(head_every=head_every)
    cases = [("ctr", dict(width=w, batch=b, embedding=embedding, **k),
              lambda w=w, b=b: ctr_workload(w, b, device=dev, rows=100_000 if cuda else 1000, embedding=embedding,
                                            head_every=head_every))
             for w, b in ctr if "ctr" in models]
    tk = dict(k, **({} if vocab == 256 else dict(vocab=vocab)), **({} if vocab_path is None else dict(vocab_path=vocab_path)))
    cases += [("transformer", dict(width=w, batch=b, seq=s, **tk),
               lambda w=w, b=b, s=s: transformer_workload(w, b, s, device=dev, dtype=torch.bfloat16 if cuda else torch.float32,
                                                          head_every=head_every, vocab=vocab, vocab_path=vocab_path))
              for w, b, s in tf if "transformer" in models]
    return cases
