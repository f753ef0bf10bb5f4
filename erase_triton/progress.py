"""Progress bars for long commands (train, bench, sweep): tqdm on stderr, so stdout keeps
only results and summaries."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm

__all__ = ["progress", "say"]


def progress(iterable=None, *, desc: str, total: int | None = None, unit: str = "it", disable: bool | None = None):
    """A tqdm bar on stderr (hidden when stderr is not a terminal and disable is None)."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=True,
                disable=disable if disable is not None else not sys.stderr.isatty())


def say(msg) -> None:
    """Print a line without breaking an active bar."""
    tqdm.write(str(msg), file=sys.stdout)
