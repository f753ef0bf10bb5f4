"""The step context: which scheduler step, if any, is active in this thread.

`LocalHead` asks only this module, never the scheduler itself, so the arrows point one way
(head -> context <- scheduler). A step owner is any object with a ``mode`` attribute and a
``detach_point(head, h, target)`` method.
"""
from __future__ import annotations

import threading

__all__ = ["current", "enter", "leave"]

_local = threading.local()


def current():
    """The step owner (a `Scheduler`) whose step() is active in this thread, or None."""
    return getattr(_local, "active", None)


def enter(owner) -> None:
    """Make `owner` the active step of this thread; raises if another step is active."""
    if current() is not None:
        raise RuntimeError("another Scheduler.step() is active in this thread")
    _local.active = owner


def leave() -> None:
    _local.active = None
