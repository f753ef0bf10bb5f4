"""Real English text for the small LM, as byte tokens (vocabulary 256).

source "pydoc":    the Python documentation topics shipped with CPython (pydoc_data).
source "fortunes": Debian's fortune cookie files (apt-get install fortunes).
"""
from __future__ import annotations

import glob
import os

import torch

FORTUNES = "/usr/share/games/fortunes"


def _pydoc() -> str:
    try:
        from pydoc_data import topics
    except ImportError as e:  # stripped Python builds
        raise ImportError("pydoc_data is missing from this Python; install the full standard library "
                          "(Debian: apt-get install libpython3-stdlib) or use source='fortunes'") from e
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def _fortunes() -> str:
    files = [f for f in glob.glob(os.path.join(FORTUNES, "*")) if os.path.isfile(f) and not f.endswith(".dat")
             and not os.path.islink(f)]
    if not files:
        raise FileNotFoundError(f"no fortune files under {FORTUNES}; install them with: apt-get install fortunes")
    return "\n".join(open(f, encoding="utf-8", errors="replace").read() for f in sorted(files))


def load_text(source: str = "pydoc", val_frac: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) uint8 byte tensors; validation is the tail of the text."""
    if source == "pydoc":
        text = _pydoc()
    elif source == "fortunes":
        text = _fortunes()
    else:
        raise ValueError(f"source must be 'pydoc' or 'fortunes', got {source!r}")
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()
    n = int(len(data) * (1 - val_frac))
    return data[:n], data[n:]


def lm_batches(data: torch.Tensor, batch: int, seq: int, generator: torch.Generator, device="cpu"):
    """Endless random windows: (x, y) long [batch, seq], y = x shifted by one byte."""
    if len(data) <= seq + 1:
        raise ValueError(f"text of {len(data)} bytes is too short for seq={seq}")
    while True:
        start = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        idx = start[:, None] + torch.arange(seq + 1)
        w = data[idx].long().to(device)
        yield w[:, :-1], w[:, 1:]
