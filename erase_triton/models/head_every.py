"""A local head after every k-th block (TinyTransformer and CTRConfig's `head_every`)."""
from __future__ import annotations


def check_head_every(head_every, n_blocks: int, name: str) -> int:
    """head_every if it is a positive int dividing n_blocks; else ValueError naming `name`."""
    if isinstance(head_every, bool) or not isinstance(head_every, int) or head_every < 1 or n_blocks % head_every:
        raise ValueError(f"head_every must be a positive int dividing {name}={n_blocks}, got {head_every!r}")
    return head_every
