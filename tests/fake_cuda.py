"""Fake CUDA streams and events for the scheduler's CPU tests: the erase ring path (forks, events,
joins, priorities) runs on CPU tensors, and every stream call it makes is logged."""
import torch

from erase_triton.scheduler import executor


class _FakeEvent:
    """Stands in for torch.cuda.Event: done when the stream it was recorded on is not busy."""

    def __init__(self, log, busy):
        self.log, self.busy, self.stream = log, busy, None

    def record(self, stream):
        self.stream = stream.name
        self.log.append(("record", stream.name))

    def query(self):
        self.log.append(("query", self.stream))
        return not self.busy(self.stream)


class _FakeStream:
    def __init__(self, log, name, priority=0):
        self.log, self.name, self.priority = log, name, priority

    def wait_event(self, ev):
        self.log.append(("wait", self.name))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: `capture` runs the step eagerly; replay() counts."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def fake_graphs(monkeypatch, log):
    """Scheduler.capture's CUDA calls on CPU (after fake_cuda): a capture runs its step eagerly, once."""
    import contextlib

    capturing = [False]

    @contextlib.contextmanager
    def graph(g, stream=None):
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def fake_cuda(monkeypatch, busy):
    """The stream side of Scheduler.step on CPU: every CUDA call it makes goes to fakes.
    busy(stream name) -> whether work recorded on that stream is still running."""
    log, n = [], [0]
    caller = _FakeStream(log, "caller")

    def stream(device=None, priority=0):
        n[0] += 1
        return _FakeStream(log, f"s{n[0] - 1}", priority)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(executor, "_current_stream", lambda device: caller)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: _FakeEvent(log, busy))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: log.append(("set", s.name)))
    return log
