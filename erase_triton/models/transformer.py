"""A six-layer decoder-only transformer with a LocalHead("ce") over the vocabulary
after every layer (or every `head_every` layers); the final head (after the last LayerNorm)
is the LM head."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..chain import check_head_every, run_chain
from ..head import LocalHead


class Layer(nn.Module):
    """Pre-norm causal self-attention + MLP."""

    def __init__(self, width: int, n_heads: int, mlp_ratio: int = 4):
        super().__init__()
        if width % n_heads:
            raise ValueError(f"width ({width}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.fc2 = nn.Linear(mlp_ratio * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, S, W = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, S, 3, self.n_heads, W // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(B, S, W))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class TinyTransformer(nn.Module):
    """head_every=k: a LocalHead after every k-th layer (layers must be a multiple of k), so
    layers/k segments: fewer detach points, fewer CE heads' work, less to overlap."""

    def __init__(self, vocab: int = 256, width: int = 256, layers: int = 6, n_heads: int = 4, max_seq: int = 128,
                 backend: str = "auto", occupancy: float | str | None = "auto", head_every: int = 1):
        super().__init__()
        self.vocab, self.max_seq = vocab, max_seq
        self.head_every = check_head_every(head_every, layers, "layers")
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_seq, width)
        self.layers = nn.ModuleList(Layer(width, n_heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.heads = nn.ModuleList(LocalHead(width, vocab, "ce", final=(i == layers // head_every - 1), backend=backend,
                                             occupancy=occupancy) for i in range(layers // head_every))

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > self.max_seq:
            raise ValueError(f"x has sequence length {x.shape[-1]} > max_seq={self.max_seq}")
        return self.tok(x) + self.pos(torch.arange(x.shape[-1], device=x.device))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y: [B, S] token ids (y = x shifted by one). Heads back-propagate; returns h."""
        return run_chain(self.layers, self.heads, self.head_every, self.embed(x), y, before_last_head=self.ln_f)

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.heads[-1].logits(self.ln_f(h))
