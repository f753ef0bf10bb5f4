"""`LocalChain`: a user's blocks in a chain, with a LocalHead after every k-th block; `check_head_every`
and `run_chain`, which the models with a `head_every` option (TinyTransformer, CTRConfig) share."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn

from .head import LocalHead


def check_head_every(head_every, n_blocks: int, name: str) -> int:
    """head_every if it is a positive int dividing n_blocks; else ValueError naming `name`."""
    if isinstance(head_every, bool) or not isinstance(head_every, int) or head_every < 1 or n_blocks % head_every:
        raise ValueError(f"head_every must be a positive int dividing {name}={n_blocks}, got {head_every!r}")
    return head_every


def run_chain(blocks: nn.ModuleList, heads: Sequence, head_every: int, h: torch.Tensor, target,
              before_last_head: nn.Module | None = None) -> torch.Tensor:
    """h through blocks with heads[j // head_every](h, target) after every head_every-th block (the forward
    of LocalChain, TinyTransformer and the CTR model's subarchitectures; heads may be any callables of
    (h, target): LocalChain.logits passes each head's activation); before_last_head, if given, runs
    on the last block's output before its head (the transformer's final LayerNorm)."""
    k, last = head_every, len(blocks) - 1
    for j, block in enumerate(blocks):  # indexing, not slicing: a ModuleList slice is a new module
        h = block(h)
        if (j + 1) % k == 0:
            h = heads[j // k](before_last_head(h) if j == last and before_last_head is not None else h, target)
    return h


class LocalChain(nn.Module):
    """blocks[0] -> blocks[1] -> ... with a LocalHead after every `head_every`-th block; the head after the
    last block is final. `forward(x, target)` trains every head (each back-propagates into its segment and
    detaches, as the Scheduler's mode says) and returns the last block's output, detached; `logits(x)`
    predicts with the final head.

    blocks: modules, each taking the previous block's output (the first takes x).
    widths: the feature size (last dim) of each head's input: one int for every head, or one per head
        (len(blocks) // head_every of them).
    out_features, loss: every head's (see LocalHead). head_kwargs go to every LocalHead (occupancy,
        backend, reduction, ignore_index, bias, activation, config, device, dtype).

        model = LocalChain([nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)], 256)
        with Scheduler("erase").step():
            opt.zero_grad(set_to_none=True); model(x, y); opt.step()
    """

    def __init__(self, blocks: Iterable[nn.Module], widths: int | Sequence[int], out_features: int = 1,
                 loss: str = "bce", *, head_every: int = 1, **head_kwargs):
        super().__init__()
        if isinstance(blocks, nn.Module) and not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise TypeError(f"blocks must be an iterable of nn.Module (one a block), got a single {type(blocks).__name__}")
        if not isinstance(blocks, nn.Module) and not hasattr(blocks, "__iter__"):
            raise TypeError(f"blocks must be an iterable of nn.Module (one a block), got {type(blocks).__name__}")
        blocks = blocks if isinstance(blocks, nn.ModuleList) else list(blocks)
        if not len(blocks):
            raise ValueError("blocks must hold at least one module")
        for i, b in enumerate(blocks):
            if not isinstance(b, nn.Module):
                raise TypeError(f"blocks[{i}] must be an nn.Module, got {type(b).__name__}")
        self.blocks = blocks if isinstance(blocks, nn.ModuleList) else nn.ModuleList(blocks)
        self.head_every = check_head_every(head_every, len(self.blocks), "len(blocks)")
        n_heads = len(self.blocks) // head_every
        widths = [widths] * n_heads if isinstance(widths, int) else list(widths)
        if len(widths) != n_heads or not all(isinstance(w, int) and w > 0 for w in widths):
            raise ValueError(f"widths must be a positive int or {n_heads} of them (one per head: len(blocks)="
                             f"{len(self.blocks)}, head_every={head_every}), got {widths!r}")
        if "final" in head_kwargs:
            raise ValueError("final is set by LocalChain: the head after the last block is final")
        self.heads = nn.ModuleList(LocalHead(w, out_features, loss, final=(i == n_heads - 1), **head_kwargs)
                                   for i, w in enumerate(widths))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return run_chain(self.blocks, self.heads, self.head_every, x, target)

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final head's logits for x (no loss, no gradients)."""
        acts = [lambda h, _target, head=head: head.act(h) for head in self.heads]  # each head's activation only
        return self.heads[-1].logits(run_chain(self.blocks, acts, self.head_every, x, None))
