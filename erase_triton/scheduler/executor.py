"""Scheduler: the same model code in three modes, and early backward on a stream ring.

    sched = Scheduler("erase")
    with sched.step():
        model(x, y)          # LocalHeads inside back-propagate at their detach points
    opt.step()

* e2e:        non-final heads are identities; the final head back-propagates through
              the whole model (the ordinary baseline).
* sequential: every head back-propagates into its block at once, on one stream.
* erase:      the forward segment between two detach points runs on its own stream of a
              ring; its head and backward are queued there right away, and the next
              segment waits only on an event recorded when the segment's forward ended,
              so backward i overlaps forward i+1. Leaving step() joins every stream
              into the caller's stream. Without CUDA: sequential semantics. The last
              three ring streams run at raised CUDA priorities (`priorities="tail"`),
              so the segments that end the step are not held up by earlier backwards.
              adaptive=True (default) decides at the entry of every `decide_every`-th step
              (default 8) whether to fork, and the steps in between keep the decision: if
              the step before the deciding one had already finished on the GPU when it
              begins (one event query, no sync), the host is the bottleneck and forks would
              only add stream calls, so the steps run the sequential path on the caller's
              stream (same kernels, same occupancy, no events); otherwise every detach
              point forks. Not every step: on the H200 an event query and record a step
              cost ~1% of a host-bound step, more than their own host time. Every detach
              point forks under CUDA-graph capture, and the steps before the first decision
              run sequentially. Either way the math is the same: only the streams (and the
              heads' "auto" occupancy) differ.
              (From the legacy default stream, the first fork's backward still serialises
              with the next segment: that stream synchronises with all others.)

Put the optimizer step after a `final=True` head (where the ring is joined back into the
caller's stream) or after the context; a step with no final head joins only at exit.

Early updates: ``Scheduler(mode, optimizer=opt)`` steps `opt` itself. In "erase" each
segment's parameters (its block's and its head's) are updated right after that segment's
backward, on its stream, so the update of block i overlaps the next segments' work instead of
waiting for the whole step; parameters no segment owns are updated when step() exits. In
"sequential", "e2e" and the host-bound steps of adaptive erase (one stream: nothing to overlap,
and one optimizer call a segment would only add host time) the whole update runs at exit. Same
math as ``opt.step()`` after the step: a detached block's parameters are read by no later segment.
A parameter reached by several segments is updated after the last of them; which one that is
comes from the previous step, so the first step (and a step whose heads differ from the
previous one's) updates at exit. A segment whose backward would reach a parameter already
updated in the step is refused with an error before its backward runs. The optimizer is then
the scheduler's to step: a direct ``opt.step()`` raises (it would apply the update twice).
Not for updates that read every gradient at once (global-norm clipping, GradScaler): keep
those after the step, without optimizer=. A step that raises keeps the updates its segments
made before the error and skips the one at exit.

The plan (which segment runs on which stream, which events order what, which early update)
is `plan.plan_detach_point`, pure Python and unit-tested on CPU; this module carries it out
with streams and events, keeps one step's state in a `StepState` made by `step()`, and logs
the plan in `last_trace`. `capture()` records a whole step in a CUDA graph.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from .. import context
from .graphs import CapturedStep, capture
from .plan import RingPlan, UpdatePlan, plan_detach_point
from .updates import SegmentUpdates, guard_step

__all__ = ["CapturedStep", "Scheduler", "StepState"]

MODES = ("e2e", "sequential", "erase")
PRIORITIES = ("rising", "tail", "off")


_STREAMS: dict = {}  # (stream id, device index, device type) -> its torch.cuda.Stream object


def _current_stream(device: torch.device):
    """torch.cuda.current_stream(device), without its cost: that call builds a new Stream
    object under a device guard each time (~6-8 µs of host time on the H200's host, more than
    everything else a step's entry and exit do). The raw lookup is cheap; the object is cached."""
    get = getattr(torch._C, "_cuda_getCurrentStream", None)
    if get is None:  # a build without CUDA (tests on fake streams)
        return torch.cuda.current_stream(device)
    key = tuple(get(device.index))
    s = _STREAMS.get(key)
    if s is None:
        s = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return s


def _leaves_of(t: torch.Tensor) -> frozenset:
    """ids of the leaf tensors whose .grad a backward from t accumulates into."""
    seen, out, stack = set(), set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            out.add(id(var))
        stack.extend(f for f, _ in fn.next_functions)
    return frozenset(out)


def _labelled(head, h, target, seg: int, beside: bool = False, act=None):
    """head.apply_loss, inside a profiler range when a profiler runs (for trace timelines)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(f"erase::backward {seg}"):
            return head.apply_loss(h, target, beside, act=act)
    return head.apply_loss(h, target, beside, act=act)


class StepState:
    """One step's state, made by `Scheduler.step()` and dropped when it exits."""

    def __init__(self, sched: "Scheduler"):
        self.cuda_device = sched._device_now() if sched.mode == "erase" and sched._has_cuda else None
        self.on_streams = self.cuda_device is not None   # erase on CUDA: the ring is used
        self.ring = RingPlan(sched.n_streams or 8)
        self.seg = 0               # the current segment
        self.k = 0                 # ring index of the current segment's stream
        self.keep: list = []       # tensors read on a stream other than their allocator's, held to the join
        self.bwd_events: dict = {}  # segment -> event after its backward (for shared leaves)
        self.forked: set = set()   # ring streams that joined this step (and must be joined back)
        self.seg_leaves: dict = {}  # segment -> (its stream, its leaf ids)
        self.updated: set = set()  # ids of parameters updated early in this step
        self.segments: list = []   # (head id, leaf ids) of each segment whose leaves were found (on the
                                   # ring or data parallel): the next update and reduce plans
        self.plan_ok = sched._early_updates()
        self.dp = None             # the data-parallel group of the step's heads (erase_triton.distributed)
        self.reduced: set = set()  # ids of parameters whose gradient was averaged in this step
        self.reduce_ok = sched.reduce_plan is not None
        self.trace: list = []
        self.caller = None         # the caller's stream (set when the step forks)
        self.host_bound = False    # adaptive erase on the caller's stream (GPU caught up)
        self.capturing = False
        self.identity_heads = 0    # e2e: non-final heads met (identities)


class Scheduler(SegmentUpdates):
    """Runs LocalHead detach points in one of MODES; see the module docstring.

    streams: ring size for "erase" (default: one stream per segment, up to 8 are
    created on demand). device: the CUDA device (default: current). adaptive: fork at
    a detach point only when the GPU is behind the host, decided every `decide_every`
    steps (see the module docstring). priorities: CUDA priorities of the ring streams (see
    `RingPlan.priority_of`): "tail" (True, the default: the top levels of PyTorch's four,
    -1 to -3, for the last three streams the previous step used, 0 for the earlier ones;
    the streams are re-created between steps when that count changes), "rising" (ring stream
    k at -k, clamped) or "off" (False: all at 0). When SMs are contended the block scheduler
    dispatches the higher-priority stream's blocks first, so the final segments, whose
    forward and backward end the step, go ahead of the earlier segments' backwards. Captured
    graphs keep the priorities (PyTorch instantiates them with per-node priority). Measured:
    docs/tuning.md#stream-priorities.
    optimizer: a torch.optim.Optimizer the scheduler steps itself, each segment's parameters as
    soon as its backward ends (early updates; see the module docstring). None (default): step
    it yourself after the step.
    """

    def __init__(self, mode: str = "erase", streams: int | None = None, device=None, adaptive: bool = True,
                 decide_every: int = 8, priorities: bool | str = True, optimizer=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if streams is not None and (not isinstance(streams, int) or streams < 1):
            raise ValueError(f"streams must be a positive int or None, got {streams!r}")
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device (the streams' device) or None, got {device!r}")
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be a bool, got {adaptive!r}")
        if isinstance(decide_every, bool) or not isinstance(decide_every, int) or decide_every < 1:
            raise ValueError(f"decide_every must be a positive int, got {decide_every!r}")
        if isinstance(priorities, bool):
            priorities = "tail" if priorities else "off"
        if priorities not in PRIORITIES:
            raise ValueError(f"priorities must be a bool or one of {PRIORITIES}, got {priorities!r}")
        self.decide_every = decide_every
        self.priorities = priorities
        self._adaptive_steps = 0   # eager (not captured) adaptive steps so far
        self._fork = False         # the current decision: fork (GPU behind) or not
        self.mode = mode
        self.n_streams = streams
        self.adaptive = adaptive
        self.device = device
        self._streams: list = []
        self._stream_prio: list = []  # the priority each ring stream was asked for (torch may clamp it)
        self._used = None             # ring streams the last forking step used ("tail" priorities)
        self._events: dict = {}  # (kind, index) -> reusable event: no event creation in a step
        self._leaf_cache: dict = {}
        self.last_trace: list = []
        self.last_forks = 0
        self._state: StepState | None = None  # the active step's state
        self._capture_owns_step = False  # capture() opened the active step (step_fn may open it again)
        self._nested = False
        self.reduce_plan: UpdatePlan | None = None  # data parallel: which segment averages which gradients
        self._warming = False  # capture()'s warm-up steps: fork like the captured step will
        # a process does not gain or lose its CUDA runtime: asked once, not at every step
        self._has_cuda = torch.cuda.is_available()
        self._fixed_device = dev if dev is not None and dev.index is not None else None  # "cuda": the current one
        self._optimizer = None
        self._unguard = None
        self.update_plan: UpdatePlan | None = None
        self.optimizer = optimizer

    def reset(self):
        """Forget what earlier steps taught the scheduler: the leaves each segment's backward
        reaches (found once per head and position, at the first step) and the early-update
        plan. Call it after changing which modules a forward uses with the same heads (e.g.
        sharing a layer between two blocks); a step whose heads differ is noticed by itself."""
        if self._in_step:
            raise RuntimeError("Scheduler.reset() cannot run inside step()")
        self._leaf_cache.clear()
        self.update_plan = None
        self.reduce_plan = None

    @property
    def optimizer(self):
        """The optimizer this scheduler steps (early updates), or None."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, opt):
        if self._in_step:
            raise RuntimeError("Scheduler.optimizer cannot change inside step()")
        if opt is not None and not isinstance(opt, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer or None, got {type(opt).__name__}")
        if isinstance(opt, torch.optim.LBFGS):
            raise ValueError("optimizer: LBFGS re-evaluates the whole model in step(closure); it cannot "
                             "update one segment at a time")
        if self._unguard is not None:
            self._unguard()
            self._unguard = None
        self._optimizer, self.update_plan = opt, None
        if opt is not None:
            # the hook lives as long as this scheduler owns the optimizer
            self._unguard = weakref.finalize(self, opt.register_step_pre_hook(guard_step).remove)

    # ------------------------------------------------------------------ the step
    def _ring_stream(self, k: int):
        while len(self._streams) <= k:
            prio = RingPlan.priority_of(len(self._streams), self.priorities, self._used)
            self._streams.append(torch.cuda.Stream(device=self._state.cuda_device, priority=prio))
            self._stream_prio.append(prio)
        return self._streams[k]

    def _retune_priorities(self):
        """("tail") Between steps: re-create the ring streams whose priority the number of
        streams the last step used now calls for (a stream's priority is fixed at creation)."""
        for k in range(len(self._streams)):
            want = RingPlan.priority_of(k, self.priorities, self._used)
            if want != self._stream_prio[k]:
                self._streams[k] = torch.cuda.Stream(device=self._state.cuda_device, priority=want)
                self._stream_prio[k] = want

    def _record(self, kind: str, index: int, stream):
        # A re-recorded event is safe to reuse: a wait already queued on the device keeps
        # the record it saw when it was issued (CUDA event semantics).
        ev = self._events.get((kind, index))
        if ev is None:
            ev = self._events[(kind, index)] = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _device_now(self) -> torch.device:
        """The CUDA device of this step: `device` if it names one, else the current one."""
        if self._fixed_device is not None:
            return self._fixed_device
        return torch.device("cuda", torch.cuda.current_device())

    @contextlib.contextmanager
    def step(self):
        """Context around one training step's forward (with LocalHeads inside)."""
        if self._state is not None and self._capture_owns_step and not self._nested:
            # capture(step_fn) opened this step; step_fn opening its own is the same step
            self._nested = True
            try:
                yield self
            finally:
                self._nested = False
            return
        if self._state is not None:
            raise RuntimeError("Scheduler.step() is not re-entrant")
        if self.mode not in MODES:  # `mode` is a plain attribute: checked again where it is used
            raise ValueError(f"Scheduler.mode must be one of {MODES}, got {self.mode!r}")
        st = StepState(self)
        context.enter(self)
        self._state = st
        self.last_trace = st.trace
        self.last_forks = 0
        ok = False
        try:
            if st.on_streams:
                st.capturing = torch.cuda.is_current_stream_capturing()
                if self.adaptive and not st.capturing and not self._warming and not self._decide():
                    # The GPU had finished the previous step before the host began the deciding
                    # one: the host is the bottleneck, nothing would overlap. Run exactly what
                    # sequential runs, and no more host calls than it: no stream lookup (the
                    # step stays on the caller's stream).
                    st.host_bound = True
                else:
                    caller = st.caller = _current_stream(st.cuda_device)
                    if self.priorities == "tail" and self._streams:
                        self._retune_priorities()
                    s0 = self._ring_stream(0)
                    s0.wait_event(self._record("start", 0, caller))
                    st.forked = {0}
                    torch.cuda.set_stream(s0)
            st.trace.append(("fwd", 0, "caller" if st.host_bound else st.ring.stream_of(0)))
            yield self
            ok = True
        finally:
            try:
                if st.on_streams and not st.host_bound:
                    self._join(st)
                    self._used = min(st.ring.n_streams, self.last_forks + 1)
                if ok and self.mode == "e2e" and st.seg == 0 and st.identity_heads:
                    raise RuntimeError(
                        f"e2e step with {st.identity_heads} LocalHead(s) and none of them final: in e2e mode only "
                        "a final head trains, so this step computed no gradient. Mark the model's top head "
                        "LocalHead(..., final=True)")
                if ok and st.dp is not None:
                    self._finish_reduce(st)
                if ok and self._optimizer is not None:
                    self._finish_updates(st)
                if st.on_streams and self.adaptive and not st.capturing \
                        and self._adaptive_steps % self.decide_every == 0:
                    # the next step decides: it asks whether this one is done (a host-bound
                    # step never left the caller's stream: the current one)
                    self._record("end", 0, st.caller if st.caller is not None else _current_stream(st.cuda_device))
            finally:
                self._state = None
                context.leave()

    @property
    def _in_step(self) -> bool:
        return self._state is not None

    def _decide(self) -> bool:
        """Whether this (eager, adaptive) step forks: decided anew every decide_every steps."""
        n = self._adaptive_steps
        self._adaptive_steps = n + 1
        if n % self.decide_every == 0 and n > 0:
            self._fork = not self._gpu_caught_up()
        return self._fork

    def _gpu_caught_up(self) -> bool:
        """True when the step before this one has finished on the GPU (or there was none)."""
        ev = self._events.get(("end", 0))
        return ev is None or ev.query()

    def identity_head(self):
        """A non-final head in e2e mode was met (LocalHead calls it)."""
        if self._state is not None:
            self._state.identity_heads += 1

    def detach_point(self, head, h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Called by LocalHead.forward inside step(): backward now, next segment elsewhere."""
        st = self._state
        if st is None:
            raise RuntimeError("Scheduler.detach_point runs inside Scheduler.step() only")
        seg, k = st.seg, st.k
        on_ring = self.mode == "erase" and not st.host_bound
        dp = self._data_parallel(st, head)
        leaves = self._leaves(head, h, seg) if on_ring or dp is not None else frozenset()
        if dp is not None:
            self._check_not_reduced(st, seg, leaves)
        # early updates in erase steps only: on one stream (sequential, and the host-bound steps
        # of adaptive erase) they would overlap nothing and cost host time (one optimizer call a segment)
        update = self._segment_update(st, head, seg, leaves) if on_ring and self._optimizer is not None else None
        if on_ring or dp is not None:
            st.segments.append((id(head), leaves))
        plan = plan_detach_point(seg, mode=self.mode, host_bound=st.host_bound, final=head.final, stream=k,
                                 ring=st.ring, leaves=leaves, earlier=st.seg_leaves, update=update)
        st.trace.extend(plan.trace())
        st.seg += 1
        if not plan.on_ring or not st.on_streams:  # one stream, or erase without CUDA
            if plan.on_ring:
                if not plan.join:
                    st.seg_leaves[seg] = (k, leaves)
                st.k = plan.next_stream if not plan.join else k
            out = _labelled(head, h, target, seg)
            if dp is not None:
                self._reduce(st, seg, head, leaves, final=head.final)
            if plan.update:
                self._update(st, seg, plan.update)
            return out
        cur = self._streams[k]
        for j in plan.wait_for:
            cur.wait_event(st.bwd_events[j])
        # what the next segment reads (a fused ReLU head's activation) is queued before its event
        act = None if plan.join else head.early_act(h)
        fwd_done = self._record("fwd", seg, cur)
        # head kernel + block backward, queued on `cur`, beside the next segment's forward
        out = _labelled(head, h, target, seg, beside=not plan.join, act=act)
        if dp is not None:
            self._reduce(st, seg, head, leaves, final=head.final)  # on `cur`, beside the next forward
        if plan.update:
            self._update(st, seg, plan.update)  # this segment's parameters, on its stream after its backward
        if plan.join:
            # After the top head comes the optimizer: it must see every gradient,
            # so the caller's stream joins the ring here rather than at exit.
            self._join(st)
            st.keep.append(out)
            return out
        st.seg_leaves[seg] = (k, leaves)
        st.bwd_events[seg] = self._record("bwd", seg, cur)
        st.k = plan.next_stream
        if plan.fork:
            self.last_forks += 1
            s_next = self._ring_stream(plan.next_stream)
            s_next.wait_event(fwd_done)
            st.forked.add(plan.next_stream)
            st.keep.append(out)
            torch.cuda.set_stream(s_next)
        return out

    def _leaves(self, head, h, seg: int) -> frozenset:
        """ids of the leaves segment `seg`'s backward (and its head) accumulates into (cached)."""
        key = (id(head), seg)
        leaves = self._leaf_cache.get(key)
        if leaves is None:
            leaves = _leaves_of(h) | {id(p) for p in head.parameters()}
            self._leaf_cache[key] = leaves
        return leaves

    def _join(self, st: "StepState"):
        """The caller's stream waits for every ring stream this step forked, and becomes current."""
        for k in sorted(st.forked):
            st.caller.wait_event(self._record("join", k, self._ring_stream(k)))
            st.trace.append(("join", k))
        st.forked = set()
        torch.cuda.set_stream(st.caller)

    # --------------------------------------------------------------- CUDA graphs
    def capture(self, step_fn, *static_inputs, warmup: int = 3) -> "CapturedStep":
        """Capture ``with self.step(): step_fn(*static_inputs)`` in one CUDA graph; see
        `erase_triton.scheduler.graphs.capture`."""
        return capture(self, step_fn, *static_inputs, warmup=warmup)
