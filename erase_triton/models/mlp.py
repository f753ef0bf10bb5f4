"""The six-block MLP proxy of DESIGN.md: each block is `layers` x (Linear + ReLU),
followed by a LocalHead; the last head is final."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..chain import LocalChain


class MLPChain(LocalChain):
    """relu_in_head=True: each block's last ReLU moves into its LocalHead
    (activation="relu"): the same function, and the fused head back-propagates through
    the ReLU itself."""

    def __init__(self, width: int, blocks: int = 6, layers: int = 2, out_features: int = 1, loss: str = "bce",
                 backend: str = "auto", occupancy: float | str | None = "auto", device=None, dtype=None,
                 relu_in_head: bool = False):
        kw = dict(device=device, dtype=dtype)

        def block():
            mods = [m for _ in range(layers) for m in (nn.Linear(width, width, **kw), nn.ReLU())]
            return nn.Sequential(*(mods[:-1] if relu_in_head else mods))
        super().__init__([block() for _ in range(blocks)], width, out_features, loss, backend=backend,
                         occupancy=occupancy, activation="relu" if relu_in_head else None, **kw)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The final head's logits for x (`logits`)."""
        return self.logits(x)
