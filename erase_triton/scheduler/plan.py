"""The scheduler's plan: pure decisions, no CUDA. Unit-tested on CPU (tests/test_scheduler.py).

* `RingPlan`: which ring stream a segment runs on, and the streams' CUDA priorities.
* `plan_detach_point`: what one detach point does -- whether the next segment forks onto
  another stream, which earlier backwards this one waits for (shared leaves), whether the
  caller's stream joins here (final head), and which parameters are updated right after
  this backward (early updates).
* `UpdatePlan`: the early updates learned from one step.

The executor (`executor.Scheduler`) carries a `DetachPlan` out with streams and events.
"""
from __future__ import annotations

import dataclasses

__all__ = ["DetachPlan", "RingPlan", "UpdatePlan", "plan_detach_point"]


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """Where segment i runs and what it waits on. Pure; no CUDA."""

    n_streams: int

    def stream_of(self, segment: int) -> int:
        """The stream of a segment when every detach point before it forks."""
        return segment % self.n_streams

    def next_stream(self, stream: int, fork: bool) -> int:
        """The next segment's stream: the next one of the ring on a fork, else the same."""
        return (stream + 1) % self.n_streams if fork else stream

    def bwd_after(self, stream: int, leaves: frozenset, earlier: dict) -> list[int]:
        """Earlier segments whose backward must finish before this one's (which runs on
        `stream`): those that accumulate .grad into a leaf this segment also reaches, on
        another stream. earlier: segment -> (its stream, its leaves)."""
        return [j for j, (k, lv) in earlier.items() if k != stream and lv & leaves]

    @staticmethod
    def priority_of(stream: int, kind: str = "rising", used: int | None = None, levels: int = 4) -> int:
        """CUDA priority of ring stream `stream` (lower numbers rank higher; PyTorch's
        streams have `levels` = 4: 0 to -3). "rising": -stream, clamped, so segment i+1's
        forward outranks segment i's backward when both wait for SMs. "tail": the top levels
        go to the last streams a step used (`used` of them; "rising" while unknown), so the
        final segments, whose forward and backward end the step, rank above every earlier
        backward. "off": 0. Evidence: docs/tuning.md#stream-priorities."""
        if kind == "off":
            return 0
        if kind == "tail" and used is not None:
            return -max(0, levels - 1 - (used - 1 - stream))
        return -min(stream, levels - 1)


@dataclasses.dataclass(frozen=True, slots=True)
class DetachPlan:
    """What one detach point does.

    stream: ring index the head and the block's backward run on, "caller" (a host-bound
    step of adaptive erase: everything on the caller's stream) or 0 (one stream: sequential, e2e).
    next_stream: ring index of the next segment's forward, "caller" after the final head.
    on_ring: the head runs on the ring (records events; may fork).
    fork: the next segment runs on another ring stream (it waits on this forward's event).
    wait_for: earlier segments whose backward must finish before this one's (shared leaves).
    join: the caller's stream joins every ring stream after this backward (the final head).
    update: per optimizer group, the parameters updated right after this backward, or None.
    """

    segment: int
    stream: int | str
    next_stream: int | str
    on_ring: bool
    fork: bool = False
    wait_for: tuple = ()
    join: bool = False
    update: list | None = None

    def trace(self) -> list:
        """The entries this detach point adds to `Scheduler.last_trace`."""
        entries = [("bwd", self.segment, self.stream, self.wait_for)]
        if self.on_ring:
            entries.append(("fwd", self.segment + 1, self.next_stream))
        return entries


@dataclasses.dataclass
class UpdatePlan:
    """Early updates learned from one step: heads[i] is the id of segment i's head, params[i]
    (per optimizer group) the parameters whose gradient is complete after segment i's backward
    (the last segment reaching them); key: the optimizer's parameter ids it was built for."""

    heads: list
    params: dict
    key: tuple

    @staticmethod
    def learn(param_groups: list, segments: list, key: tuple) -> "UpdatePlan":
        """segments: [(head id, leaf ids)] of one step, in order; param_groups: the optimizer's."""
        owner = {}
        for i, (_, leaves) in enumerate(segments):
            for pid in leaves:
                owner[pid] = i
        params = {}
        for i in range(len(segments)):
            per_group = [[p for p in g["params"] if owner.get(id(p)) == i] for g in param_groups]
            if any(per_group):
                params[i] = per_group
        return UpdatePlan([h for h, _ in segments], params, key)

    def update_after(self, segment: int, head_id: int):
        """(params per group or None, still valid): the update after `segment`'s backward, if
        this step's segment is the one the plan was learned from; else the plan stops applying."""
        if segment >= len(self.heads) or self.heads[segment] != head_id:
            return None, False
        return self.params.get(segment), True


def plan_detach_point(segment: int, *, mode: str, host_bound: bool, final: bool, stream: int, ring: RingPlan,
                      leaves: frozenset = frozenset(), earlier: dict | None = None,
                      update: list | None = None) -> DetachPlan:
    """Decide what detach point `segment` does.

    mode: the scheduler's mode; host_bound: an adaptive erase step that runs on the caller's
    stream (the GPU had caught up with the host); final: the head is `final=True`;
    stream: ring index of this segment's forward; leaves / earlier: this segment's leaf ids and
    {earlier segment: (its stream, its leaves)}; update: the early update after this backward.
    Only a non-host-bound "erase" step runs on the ring; every non-final head there forks.
    """
    if mode != "erase" or host_bound:
        return DetachPlan(segment, "caller" if host_bound else 0, "caller" if host_bound else 0, False,
                          update=update)
    fork = not final
    wait_for = tuple(ring.bwd_after(stream, leaves, earlier)) if earlier else ()
    nxt = "caller" if final else ring.next_stream(stream, fork)
    return DetachPlan(segment, stream, nxt, True, fork=fork and nxt != stream, wait_for=wait_for, join=final,
                      update=update)
