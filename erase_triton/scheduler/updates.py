"""Early updates and data-parallel gradient averaging, per segment: what the executor does right
after a segment's backward (average the gradients it completes, then step its parameters) and at
step exit (the rest). Which segment completes which parameter comes from `plan.UpdatePlan`."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from .collectives import all_reduce_grads
from .plan import UpdatePlan

if TYPE_CHECKING:
    from .executor import StepState

__all__ = ["SegmentUpdates", "guard_step"]

_local = threading.local()  # the optimizer a Scheduler is stepping right now (see guard_step)


def guard_step(opt, args, kwargs):
    """Step pre-hook of an optimizer a Scheduler updates: only the scheduler may step it."""
    if getattr(_local, "updating", None) is not opt:
        raise RuntimeError(
            "this optimizer is stepped by a Scheduler(optimizer=...): each segment's parameters are "
            "updated when its backward ends and the rest when step() exits, so calling "
            "optimizer.step() as well would apply the update twice. Drop the call, or set "
            "scheduler.optimizer = None to step it yourself.")


def _step_subset(opt, per_group: list):
    """opt.step() over a subset of its parameters: per_group[i] lists group i's parameters to
    update (the groups' hyperparameters and the optimizer's per-parameter state are shared)."""
    groups = opt.param_groups
    saved = [g["params"] for g in groups]
    try:
        for g, ps in zip(groups, per_group):
            g["params"] = ps
        opt.param_groups = [g for g, ps in zip(groups, per_group) if ps]
        _local.updating = opt
        opt.step()
    finally:
        _local.updating = None
        for g, ps in zip(groups, saved):
            g["params"] = ps
        opt.param_groups = groups


def _param_key(opt) -> tuple:
    return tuple(id(p) for g in opt.param_groups for p in g["params"])


class SegmentUpdates:
    """The Scheduler's per-segment updates (a mixin: its state lives on the Scheduler and its StepState)."""

    # ------------------------------------------------------------- data parallel
    def _data_parallel(self, st: "StepState", head):
        """The head's data-parallel group (also at world size 1: the same collectives), else None."""
        dp = head.data_parallel
        if dp is None or dp.local:
            return None
        if dp.sharded and self._capture_owns_step:
            # FSDP2 gathers and frees the bodies' parameters in Python hooks, which a graph's replay skips
            raise NotImplementedError(
                "Scheduler.capture of a model whose segment bodies are sharded (data_parallel(model, shard=True) "
                "or fully_shard): FSDP gathers and frees their parameters in Python hooks, which a CUDA graph "
                "does not replay. Capture a replicated model (data_parallel(model)) or run sharded steps eagerly")
        if st.dp is None:
            st.dp = dp
        elif st.dp is not dp:
            raise RuntimeError("the LocalHeads of one step belong to different data_parallel() calls; prepare "
                               "the whole model with one erase_triton.distributed.data_parallel(model)")
        return dp

    def _check_not_reduced(self, st: "StepState", seg: int, leaves: frozenset):
        """Before segment seg's backward: it must not add to a gradient already averaged."""
        hit = st.reduced & leaves
        if hit:
            raise RuntimeError(
                f"data parallel: segment {seg}'s backward reaches {len(hit)} parameter(s) whose gradient an "
                f"earlier segment of this step already averaged; the segments differ from the step the reduce "
                f"plan was learned from. Call Scheduler.reset() after re-wiring which modules a forward uses.")

    def _reduce(self, st: "StepState", seg: int, head, leaves: frozenset, final: bool):
        """After segment seg's backward, on its stream: average the gradients it completes (the
        plan's), and after the final head every gradient not averaged yet."""
        todo = []
        if st.reduce_ok:
            params, st.reduce_ok = self.reduce_plan.update_after(seg, id(head))
            todo = list(params[0]) if params else []
        if final:
            todo = [p for p in st.dp.params if id(p) not in st.reduced]
        if todo:
            if torch.autograd._profiler_enabled():  # a named range for traces (bench_data_parallel.py)
                with torch.profiler.record_function(f"erase::allreduce {seg}"):
                    n = all_reduce_grads(todo, st.dp)
            else:
                n = all_reduce_grads(todo, st.dp)
            st.reduced.update(id(p) for p in todo)
            st.trace.append(("allreduce", seg, n))

    def _finish_reduce(self, st: "StepState"):
        """At exit: average what no segment did (no final head ran), and learn the reduce plan."""
        rest = [p for p in st.dp.params if id(p) not in st.reduced]
        if rest:
            st.trace.append(("allreduce", "exit", all_reduce_grads(rest, st.dp)))
            st.reduced.update(id(p) for p in rest)
        heads = [h for h, _ in st.segments]
        if self.reduce_plan is None or not st.reduce_ok or heads != self.reduce_plan.heads:
            key = tuple(id(p) for p in st.dp.params)
            self.reduce_plan = UpdatePlan.learn([{"params": list(st.dp.params)}], st.segments, key)

    # ------------------------------------------------------------- early updates
    def _early_updates(self) -> bool:
        """At step entry: whether the update plan (learned from the previous step) still fits."""
        opt = self._optimizer
        if opt is None or self.mode != "erase":
            return False
        if self.update_plan is not None and self.update_plan.key != _param_key(opt):
            self.update_plan = None  # the optimizer's parameters changed: learn again
        return self.update_plan is not None

    def _segment_update(self, st: "StepState", head, seg: int, leaves: frozenset):
        """Before segment seg's backward: refuse it if it reaches a parameter already updated in
        this step; return the parameters (per group) the plan updates after it, or None."""
        hit = st.updated & leaves
        if hit:
            shapes = [tuple(p.shape) for g in self._optimizer.param_groups for p in g["params"] if id(p) in hit]
            raise RuntimeError(
                f"Scheduler(optimizer=...): segment {seg}'s backward reaches {len(hit)} parameter(s) (shapes "
                f"{shapes[:4]}) already updated earlier in this step; the segments differ from the step the "
                f"update plan was learned from. Parameters shared across segments must be reached the same "
                f"way every step, or step the optimizer after the step (optimizer=None).")
        if not st.plan_ok:
            return None
        params, st.plan_ok = self.update_plan.update_after(seg, id(head))
        return params

    def _update(self, st: "StepState", seg, per_group: list):
        st.updated.update(id(p) for ps in per_group for p in ps)
        st.trace.append(("update", seg, sum(map(len, per_group))))
        _step_subset(self._optimizer, per_group)

    def _finish_updates(self, st: "StepState"):
        """At exit, on the caller's stream: update what no segment did; learn the plan anew if
        this step's segments are not the plan's."""
        opt = self._optimizer
        rest = [[p for p in g["params"] if id(p) not in st.updated] for g in opt.param_groups]
        if any(rest):
            self._update(st, "exit", rest)
        if self.mode == "erase" and not st.host_bound and st.segments:  # its segments are the next plan
            heads = [h for h, _ in st.segments]
            if self.update_plan is None or not st.plan_ok or heads != self.update_plan.heads:
                self.update_plan = UpdatePlan.learn(opt.param_groups, st.segments, _param_key(opt))
