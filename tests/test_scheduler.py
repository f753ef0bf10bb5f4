"""LocalHead and Scheduler on CPU: the three modes against hand-written autograd.

Long because it is the scheduler's whole CPU contract in one place (modes, the plan, fake-stream
ring, adaptive forking, priorities, early updates, compiled blocks), sharing one set of fixtures."""
import contextlib
import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from erase_triton import LaunchConfig, LocalChain, LocalHead, Scheduler
from erase_triton.scheduler import graphs
from fake_cuda import fake_cuda as _fake_cuda
from erase_triton import reference
from erase_triton.reference import head_loss
from erase_triton.scheduler import RingPlan


class Chain(nn.Module):
    """n blocks of Linear+ReLU+Linear, a LocalHead after each; the last head is final.
    activation="relu": the heads apply a ReLU to their block's output (LocalHead(activation=))."""

    def __init__(self, d=24, n=4, c=3, loss="bce", share=False, activation=None, backend="auto"):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d)) for _ in range(n))
        if share:  # block 2 reuses block 0's first layer: a parameter reached from two segments
            self.blocks[2][0] = self.blocks[0][0]
        self.heads = nn.ModuleList(LocalHead(d, c, loss, final=(i == n - 1), activation=activation, backend=backend)
                                   for i in range(n))

    def forward(self, x, y):
        h = x
        for blk, head in zip(self.blocks, self.heads):
            h = head(blk(h), y)
        return h


def data(loss, n=37, d=24, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, c, (n,), generator=g) if loss == "ce" else torch.rand(n, c, generator=g).round()
    return x, y


def grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def detached_reference(model, x, y, losses=None):
    """ERASE's math written by hand: each block sees a detached input, own loss, own backward.
    losses: a list that receives each head's loss."""
    h = x
    for blk, head in zip(model.blocks, model.heads):
        out = blk(h)
        if head.activation == "relu":
            out = F.relu(out)
        loss = head_loss(F.linear(out, head.weight, head.bias), y, head.loss, "mean", -100)
        loss.backward()
        if losses is not None:
            losses.append(loss.detach())
        h = out.detach()
    return grads(model)


def e2e_reference(model, x, y):
    h = x
    for blk, head in zip(model.blocks, model.heads):
        h = blk(h)
        if head.activation == "relu":
            h = F.relu(h)
    head = model.heads[-1]
    head_loss(F.linear(h, head.weight, head.bias), y, head.loss, "mean", -100).backward()
    return grads(model)


def assert_same_grads(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def erase_on_fake_streams(model, x, y, monkeypatch):
    """One erase step on fake CUDA streams, forking at every detach point: the ring path the GPU runs
    (forks, events, joins), not the CPU's sequential fallback. Returns the gradients."""
    log = _fake_cuda(monkeypatch, lambda name: True)
    model.zero_grad(set_to_none=True)
    sched = Scheduler("erase", adaptive=False)
    with sched.step():
        model(x, y)
    monkeypatch.undo()
    assert sched.last_forks == len(model.heads) - 1 and ("set", "s1") in log, sched.last_trace
    return grads(model)


def run(model, mode, x, y):
    model.zero_grad(set_to_none=True)
    sched = Scheduler(mode)
    with sched.step():
        model(x, y)
    return grads(model), sched


@pytest.mark.parametrize("loss,activation", [("bce", None), ("ce", None), ("mse", None), ("bce", "relu"),
                                             ("ce", "relu")])
def test_sequential_and_erase_equal_detached_reference(loss, activation, monkeypatch):
    torch.manual_seed(0)
    model = Chain(loss=loss, activation=activation)
    x, y = data(loss)
    model.zero_grad(set_to_none=True)
    ref_losses = []
    ref = detached_reference(copy.deepcopy(model), x, y, ref_losses)
    seq, _ = run(model, "sequential", x, y)
    assert_same_grads(seq, ref)
    for hd, want in zip(model.heads, ref_losses):  # every head's loss, not only its gradients
        torch.testing.assert_close(hd.last_loss, want.float(), rtol=1e-5, atol=1e-6)
    assert_same_grads(erase_on_fake_streams(model, x, y, monkeypatch), ref)


@pytest.mark.parametrize("loss,activation", [("bce", None), ("ce", None), ("bce", "relu")])
def test_e2e_equals_ordinary_autograd(loss, activation):
    torch.manual_seed(1)
    model = Chain(loss=loss, activation=activation)
    x, y = data(loss)
    ref = e2e_reference(copy.deepcopy(model), x, y)
    got, _ = run(model, "e2e", x, y)
    # non-final heads are identities in e2e: they get no gradient at all
    assert_same_grads(got, ref)
    assert all(h.weight.grad is None for h in model.heads[:-1])


def _narrowing_blocks(dims):
    return [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(dims, dims[1:])]


@pytest.mark.parametrize("head_every", [1, 2])
def test_local_chain_equals_hand_written_chain(head_every, monkeypatch):
    # erase == sequential == each segment trained by hand on a detached input; e2e == plain autograd
    torch.manual_seed(3)
    dims = [24, 20, 16, 12, 10]
    widths = dims[1:][head_every - 1::head_every]
    model = LocalChain(_narrowing_blocks(dims), widths, 3, "ce", head_every=head_every)
    assert [h.in_features for h in model.heads] == widths and [h.final for h in model.heads][-1]
    x, y = data("ce")

    def by_hand(m, detach):
        h = x
        for j, blk in enumerate(m.blocks):
            h = blk(h)
            if (j + 1) % head_every == 0 and (detach or j == len(m.blocks) - 1):
                head = m.heads[j // head_every]
                head_loss(F.linear(h, head.weight, head.bias), y, "ce", "mean", -100).backward()
                h = h.detach()
        return grads(m)
    ref = by_hand(copy.deepcopy(model), detach=True)
    seq, _ = run(model, "sequential", x, y)
    assert_same_grads(seq, ref)
    assert_same_grads(erase_on_fake_streams(model, x, y, monkeypatch), ref)
    e2e, _ = run(model, "e2e", x, y)
    assert_same_grads(e2e, by_hand(copy.deepcopy(model), detach=False))
    h = x
    for blk in model.blocks:
        h = blk(h)
    torch.testing.assert_close(model.logits(x), F.linear(h, model.heads[-1].weight, model.heads[-1].bias))


def test_local_chain_rejects_bad_arguments():
    blocks = _narrowing_blocks([8, 8, 8, 8, 8])
    with pytest.raises(ValueError, match=r"widths must be a positive int or 2 of them"):
        LocalChain(blocks, [8, 8, 8], head_every=2)
    with pytest.raises(ValueError, match=r"head_every must be a positive int dividing len\(blocks\)=4"):
        LocalChain(blocks, 8, head_every=3)
    with pytest.raises(ValueError, match="final is set by LocalChain"):
        LocalChain(blocks, 8, final=True)
    with pytest.raises(ValueError, match="at least one module"):
        LocalChain([], 8)
    with pytest.raises(TypeError, match=r"blocks\[1\] must be an nn.Module"):
        LocalChain([nn.ReLU(), lambda t: t], 8)


def test_relu_head_fused_and_torch_agree_and_return_relu():
    # the fused head (kernel masks grad at the ReLU's input) against backend="torch" (F.relu
    # under autograd): same gradients, same outputs, and the output really is relu(block(x))
    torch.manual_seed(3)
    fused = Chain(activation="relu")
    plain = copy.deepcopy(fused)
    for hd in plain.heads:
        hd.backend = "torch"
    x, y = data("bce")
    for mode in ("sequential", "erase"):
        got, _ = run(fused, mode, x, y)
        want, _ = run(plain, mode, x, y)
        assert_same_grads(got, want)
    with Scheduler("sequential").step():
        out = fused.heads[0](fused.blocks[0](x), y)
    torch.testing.assert_close(out, F.relu(fused.blocks[0](x)).detach())
    assert not out.requires_grad and (out >= 0).all()
    fused.eval()
    torch.testing.assert_close(fused.heads[0](fused.blocks[0](x), y), F.relu(fused.blocks[0](x)))


def test_no_scheduler_is_sequential():
    torch.manual_seed(2)
    model = Chain()
    x, y = data("bce")
    seq, _ = run(model, "sequential", x, y)
    model.zero_grad(set_to_none=True)
    model(x, y)
    assert_same_grads(grads(model), seq)


def test_head_matches_linear_plus_loss():
    torch.manual_seed(3)
    blk = nn.Linear(20, 30)
    head = LocalHead(30, 5, "ce")
    lin = nn.Linear(30, 5)
    lin.load_state_dict({"weight": head.weight.detach(), "bias": head.bias.detach()})
    blk2 = copy.deepcopy(blk)
    x, y = torch.randn(33, 20), torch.randint(0, 5, (33,))
    out = head(blk(x), y)
    assert not out.requires_grad
    ref_loss = F.cross_entropy(lin(blk2(x)), y)
    ref_loss.backward()
    torch.testing.assert_close(head.last_loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, lin.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.bias.grad, lin.bias.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blk.weight.grad, blk2.weight.grad, rtol=1e-5, atol=1e-6)


def test_head_accumulates_across_calls():
    torch.manual_seed(4)
    head = LocalHead(16, 1)
    h1, h2 = torch.randn(9, 16), torch.randn(9, 16)
    y1, y2 = torch.rand(9), torch.rand(9)
    head(h1, y1)
    head(h2, y2)
    lin = nn.Linear(16, 1)
    lin.load_state_dict({"weight": head.weight.detach(), "bias": head.bias.detach()})
    (F.binary_cross_entropy_with_logits(lin(h1).squeeze(1), y1)
     + F.binary_cross_entropy_with_logits(lin(h2).squeeze(1), y2)).backward()
    torch.testing.assert_close(head.weight.grad, lin.weight.grad, rtol=1e-5, atol=1e-6)


def test_eval_and_no_grad_do_no_loss_work():
    head = LocalHead(8, 2, "mse")
    h, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 2)
    head.eval()
    assert head(h, y) is h
    head.train()
    with torch.no_grad():
        assert head(h, y) is h
    assert head.last_loss is None and head.weight.grad is None


def test_shared_parameter_is_ordered_in_plan():
    torch.manual_seed(5)
    model = Chain(share=True)
    x, y = data("bce")
    model.zero_grad(set_to_none=True)
    ref = detached_reference(copy.deepcopy(model), x, y)
    got, sched = run(model, "erase", x, y)
    assert_same_grads(got, ref)
    bwd = {e[1]: e[3] for e in sched.last_trace if e[0] == "bwd"}
    assert bwd[2] == (0,), sched.last_trace  # segment 2 accumulates after segment 0


def test_erase_trace_is_a_ring():
    model = Chain(n=3)
    x, y = data("bce")
    sched = Scheduler("erase", streams=2)
    with sched.step():
        model(x, y)
    assert sched.last_trace == [
        ("fwd", 0, 0), ("bwd", 0, 0, ()), ("fwd", 1, 1), ("bwd", 1, 1, ()), ("fwd", 2, 0),
        ("bwd", 2, 0, ()), ("fwd", 3, "caller"),
    ]


def test_ring_plan():
    p = RingPlan(3)
    assert [p.stream_of(i) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [p.next_stream(k, True) for k in range(3)] == [1, 2, 0]
    assert [p.next_stream(k, False) for k in range(3)] == [0, 1, 2]
    earlier = {0: (0, frozenset({1, 2})), 1: (1, frozenset({3})), 3: (0, frozenset({2}))}
    # segment 4 on stream 1 shares leaf 2 with 0 and 3 (stream 0); 1 shares leaf 3 but on stream 1
    assert p.bwd_after(1, frozenset({2, 3}), earlier) == [0, 3]
    # a segment that stayed on stream 0 (no fork) needs no event for 0 and 3
    assert p.bwd_after(0, frozenset({2, 3}), earlier) == [1]


def test_ring_plan_priorities():
    p = RingPlan.priority_of
    assert [p(k) for k in range(6)] == [0, -1, -2, -3, -3, -3]  # rising, clamped to 4 levels
    assert [p(k, "tail", 6) for k in range(6)] == [0, 0, 0, -1, -2, -3]  # the last streams on top
    assert [p(k, "tail", None) for k in range(3)] == [0, -1, -2]  # unknown count: rising
    assert [p(k, "tail", 2) for k in range(2)] == [-2, -3]
    assert [p(k, "off", 6) for k in range(6)] == [0] * 6


@pytest.mark.parametrize("priorities,want", [
    (False, [[0] * 6, [0] * 6]),
    ("rising", [[0, -1, -2, -3, -3, -3]] * 2),
    (True, [[0, -1, -2, -3, -3, -3], [0, 0, 0, -1, -2, -3]]),  # "tail": re-created once the count is known
])
def test_ring_streams_get_their_priorities(monkeypatch, priorities, want):
    # erase, always forking: six segments on six ring streams, two steps
    torch.manual_seed(0)
    model = Chain(n=6)
    for hd in model.heads:
        hd.backend = "torch"
    x, y = data("bce")
    ref = detached_reference(copy.deepcopy(model), x, y)
    _fake_cuda(monkeypatch, lambda name: True)
    sched = Scheduler("erase", adaptive=False, priorities=priorities)
    for step_want in want:
        model.zero_grad(set_to_none=True)
        with sched.step():
            model(x, y)
        assert [s.priority for s in sched._streams] == step_want
        assert_same_grads(grads(model), ref)


def test_scheduler_rejects_bad_args_and_nesting():
    with pytest.raises(ValueError, match="mode must be one of"):
        Scheduler("fast")
    with pytest.raises(ValueError, match="streams must be a positive int"):
        Scheduler("erase", streams=0)
    with pytest.raises(ValueError, match="adaptive must be a bool"):
        Scheduler("erase", adaptive="yes")
    with pytest.raises(ValueError, match="priorities must be a bool or one of"):
        Scheduler("erase", priorities="high")
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        Scheduler("erase", device="cpu")
    Scheduler("erase", device="cuda:0")  # checked without touching CUDA
    s = Scheduler("erase")
    with s.step():
        with pytest.raises(RuntimeError, match="another Scheduler.step"):
            with Scheduler("sequential").step():
                pass


def test_capture_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        Scheduler("erase").capture(lambda: None)


def test_capture_turns_autocast_cache_off():
    # capture() runs its warm-up and capture under this context: an enclosing autocast's cached casts
    # would otherwise be read by the graph, never re-cast (stale after an in-place optimizer update).
    # Shown with CPU autocast, whose cache behaves the same.
    lin, x = nn.Linear(16, 16), torch.randn(4, 16)
    assert isinstance(graphs._autocast_cache_off("cpu"), type(contextlib.nullcontext()))  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = lin(x)
        with torch.no_grad():
            lin.weight.mul_(-1.0)
        assert torch.equal(lin(x), a)  # autocast's cache: the cast made before the update
        with graphs._autocast_cache_off("cpu"):
            assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
            b = lin(x)
        assert torch.is_autocast_cache_enabled()  # restored on exit
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(b, lin(x))  # the cast of the updated weight
    assert not torch.equal(a, b)


def test_head_occupancy_auto_and_validation():
    from erase_triton.head import DEFAULT_OCCUPANCY

    auto = LocalHead(8, 1)
    assert auto.auto_occupancy and auto.config.occupancy is None
    assert auto.beside_config.occupancy == DEFAULT_OCCUPANCY
    fixed = LocalHead(8, 1, occupancy=0.5)
    assert fixed.config.occupancy == fixed.beside_config.occupancy == 0.5
    # "auto" beside the next segment: 1/8 below WHOLE_DEVICE_MIN_ELEMENTS elements of h, the whole device from there
    from erase_triton.head import WHOLE_DEVICE_MIN_ELEMENTS as big
    small_h, big_h = torch.empty(4096, 1024), torch.empty(big // 8, 8)
    assert auto.launch_config(small_h, beside=True).occupancy == DEFAULT_OCCUPANCY
    assert auto.launch_config(big_h, beside=True).occupancy is None
    assert auto.launch_config(small_h, beside=False).occupancy is None
    assert fixed.launch_config(big_h, beside=True).occupancy == 0.5  # a chosen occupancy is kept at any size
    # ...and a vocabulary head (CE, more than 512 classes) takes the whole device at any size
    assert LocalHead(8, 513, "ce").launch_config(small_h, beside=True).occupancy is None
    assert LocalHead(8, 512, "ce").launch_config(small_h, beside=True).occupancy == DEFAULT_OCCUPANCY
    assert LocalHead(8, 1000, "ce", occupancy=0.25).launch_config(small_h, beside=True).occupancy == 0.25
    # configure(): other launch fields in both settings, the occupancy rule kept ("auto" stays auto,
    # a fixed occupancy stays fixed); a replaced beside_config is the user's (no size rule)
    for hd in (auto, fixed):
        assert hd.configure(vocab_path="row_chunks", deterministic=True) is hd
        assert hd.config.vocab_path == hd.beside_config.vocab_path == "row_chunks" and hd.config.deterministic
    assert auto.launch_config(small_h, beside=True).occupancy == DEFAULT_OCCUPANCY
    assert auto.launch_config(big_h, beside=True) is auto.config and auto.config.vocab_path == "row_chunks"
    assert fixed.launch_config(big_h, beside=True).occupancy == 0.5
    with pytest.raises(ValueError, match="configure\\(\\) takes LaunchConfig fields other than occupancy"):
        auto.configure(occupancy=0.5)
    with pytest.raises(ValueError, match="got vocab"):
        auto.configure(vocab="row_chunks")
    with pytest.raises(ValueError, match="vocab_path must be one of"):
        auto.configure(vocab_path="rows")
    auto.beside_config = mine = LaunchConfig(0.25)
    assert auto.launch_config(big_h, beside=True) is mine
    with pytest.raises(ValueError, match="occupancy must be a number"):
        LocalHead(8, 1, occupancy="half")
    with pytest.raises(ValueError, match="occupancy must be a number in"):
        LocalHead(8, 1, occupancy=1.5)
    with pytest.raises(ValueError, match="supports 2 <= C"):
        LocalHead(8, 1, "ce")
    with pytest.raises(ValueError, match="activation must be one of"):
        LocalHead(8, 1, activation="gelu")


def test_frozen_head_still_backpropagates():
    blk = nn.Linear(6, 8)
    head = LocalHead(8, 1)
    head.requires_grad_(False)
    head(blk(torch.randn(5, 6)), torch.rand(5))
    assert head.weight.grad is None and blk.weight.grad is not None


def test_head_accumulates_into_non_contiguous_grad():
    torch.manual_seed(6)
    head = LocalHead(16, 3, "mse")
    g0 = torch.randn(16, 3).t()  # non-contiguous [3, 16]
    head.weight.grad = g0.clone().t().contiguous().t()
    h, y = torch.randn(7, 16), torch.randn(7, 3)
    head(h, y)
    lin = nn.Linear(16, 3)
    lin.load_state_dict({"weight": head.weight.detach(), "bias": head.bias.detach()})
    F.mse_loss(lin(h), y).backward()
    torch.testing.assert_close(head.weight.grad, g0 + lin.weight.grad, rtol=1e-5, atol=1e-6)


def test_time_eager_modes_interleaves_every_variant():
    from erase_triton.bench import time_eager_modes
    torch.manual_seed(0)
    model = Chain(n=3)
    x, y = data("bce")
    calls = []
    variants = {m: Scheduler(m) for m in ("e2e", "sequential", "erase")}
    for name, s in variants.items():
        orig = s.step

        def step(orig=orig, name=name):
            calls.append(name)
            return orig()
        s.step = step
    per_round = {}
    res = time_eager_modes(model, (x, y), variants, iters=2, rounds=per_round)
    assert set(per_round) == set(variants) and all(len(v) == 2 for v in per_round.values())
    assert set(res) == set(variants) and all(ms > 0 and host > 0 for ms, _, host in res.values())
    # interleaved, not one mode after another: each round runs every variant once
    assert sorted(calls[-6:-3]) == sorted(calls[-3:]) == ["e2e", "erase", "sequential"]
    # wall blocks: after the event rounds, each round runs K consecutive steps of every variant in turn
    calls.clear()
    wall = {}
    time_eager_modes(model, (x, y), variants, iters=2, wall_steps=3, wall=wall)
    assert set(wall) == set(variants) and all(len(v) == 2 and min(v) > 0 for v in wall.values())
    blocks = calls[-18:]
    assert all(len(set(blocks[i:i + 3])) == 1 for i in range(0, 18, 3))  # 3 steps of one variant a block
    assert sorted(blocks[9:18:3]) == sorted(blocks[0:9:3]) == ["e2e", "erase", "sequential"]


@pytest.mark.parametrize("share", [False, True])
def test_adaptive_plan_on_fake_streams(monkeypatch, share):
    # Adaptive erase decides once a step: the GPU done with the previous step (host-bound) ->
    # the sequential path on the caller's stream, no stream calls but the step's end event;
    # the GPU behind -> a fork at every detach point, a shared leaf ordered across streams.
    torch.manual_seed(0)
    model = Chain(share=share)
    for hd in model.heads:
        hd.backend = "torch"
    x, y = data("bce")
    ref = detached_reference(copy.deepcopy(model), x, y)
    gpu_behind = [False]
    log = _fake_cuda(monkeypatch, lambda name: gpu_behind[0])
    sched = Scheduler("erase", decide_every=1)

    def step():
        log.clear()
        model.zero_grad(set_to_none=True)
        with sched.step():
            model(x, y)
        assert_same_grads(grads(model), ref)
        return [e[2] for e in sched.last_trace if e[0] in ("fwd", "bwd")]

    # first step: nothing to ask yet -> sequential; it records only its end event
    assert step() == ["caller"] * 5, sched.last_trace
    assert sched.last_forks == 0 and log == [("record", "caller")], log
    gpu_behind[0] = True  # that step's work still runs when the next one begins: fork everywhere
    where = step()
    assert where[::2] == [0, 1, 2, 3, "caller"] and where[1::2] == [0, 1, 2, 3], sched.last_trace
    assert sched.last_forks == 3
    bwd = {e[1]: e[3] for e in sched.last_trace if e[0] == "bwd"}
    assert bwd[2] == ((0,) if share else ()), sched.last_trace  # segment 2 (stream 2) after 0's backward
    assert log[0] == ("query", "caller") and ("set", "s0") in log and log[-1] == ("record", "caller"), log
    assert ("set", "caller") in log  # joined back before the end event
    gpu_behind[0] = False  # caught up: back to the sequential path
    assert step() == ["caller"] * 5, sched.last_trace
    assert log == [("query", "caller"), ("record", "caller")], log
    # not adaptive: always forks, never asks
    sched = Scheduler("erase", adaptive=False)
    assert step()[::2] == [0, 1, 2, 3, "caller"]
    assert not [e for e in log if e[0] == "query"], log


def test_adaptive_decides_every_k_steps(monkeypatch):
    # decide_every=3: steps 0-2 run sequentially (nothing asked yet); only step 2 records the end
    # event, step 3 queries it and its decision holds for steps 3-5; step 5 records, step 6 decides.
    torch.manual_seed(0)
    model = Chain()
    for hd in model.heads:
        hd.backend = "torch"
    x, y = data("bce")
    gpu_behind = [True]
    log = _fake_cuda(monkeypatch, lambda name: gpu_behind[0])
    sched = Scheduler("erase", decide_every=3)
    events, forks = [], []
    for i in range(9):
        if i == 5:
            gpu_behind[0] = False  # step 5 keeps step 3's decision; step 6 sees the GPU caught up
        log.clear()
        with sched.step():
            model(x, y)
        events.append([e for e in log if e[0] in ("query",) or e == ("record", "caller")])
        forks.append(sched.last_forks)
    assert forks == [0, 0, 0, 3, 3, 3, 0, 0, 0], forks
    queries = [i for i, ev in enumerate(events) if ("query", "caller") in ev]
    assert queries == [3, 6], events
    assert ("record", "caller") in events[2] and ("record", "caller") not in events[1], events
    with pytest.raises(ValueError, match="decide_every must be a positive int"):
        Scheduler("erase", decide_every=0)


def test_free_heads_bound_and_summary():
    # study's FreeHead (bench_schedule --free-heads): the block gets a constant gradient, the head
    # nothing; and the summary reports the bound (PyTorch-heads erase / free-heads erase) next to fused/PyTorch.
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_schedule.py")
    spec = importlib.util.spec_from_file_location("bench_schedule", path)
    bs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bs)
    torch.manual_seed(0)
    from erase_triton.models import MLPChain
    from erase_triton.bench import free_heads
    model = free_heads(MLPChain(16, blocks=3))
    x, y = torch.randn(8, 16), torch.rand(8).round()
    with Scheduler("erase").step():
        model(x, y)
    assert all(hd.weight.grad is None for hd in model.heads)
    ref = MLPChain(16, blocks=3)
    ref.load_state_dict(model.state_dict())
    h = x
    for blk in ref.blocks:
        out = blk(h)
        out.backward(torch.full_like(out, 1e-4))
        h = out.detach()
    for (k, p), q in zip(model.blocks.named_parameters(), ref.blocks.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=k)
    desc = dict(model="mlp", width=16, batch=8, dtype="tf32", streams="auto", exec="graph", mode="erase")
    rows = [dict(desc, heads="torch", ms=3.0), dict(desc, heads="fused", ms=2.5), dict(desc, heads="free", ms=2.0),
            dict(desc, heads="free-replayed", ms=2.4), dict(desc, heads="torch-compile", ms=2.75),
            dict(desc, heads="torch", mode="e2e", ms=3.3), dict(desc, heads="torch", streams="early-update", ms=2.9),
            dict(desc, heads="fused", streams="early-update", ms=2.4)]
    eager = dict(desc, exec="eager", heads="fused", ms=4.0, host_ms=3.9)
    rows += [dict(eager, mode="sequential", paired_seq_over_this=1.0, wall_paired_seq_over_this=1.0),
             dict(eager, mode="erase", paired_seq_over_this=1.02, wall_paired_seq_over_this=1.01),
             dict(eager, mode="erase", streams="always-fork", paired_seq_over_this=1.1, wall_paired_seq_over_this=0.93),
             dict(eager, mode="sequential", streams="again", paired_seq_over_this=0.99)]
    s, = bs.summarize(rows)
    assert s["graph_fused_vs_torch_heads"] == pytest.approx(1.2) and s["graph_free_vs_torch_heads"] == pytest.approx(1.5)
    assert s["graph_free_replayed_vs_torch_heads"] == pytest.approx(1.25)
    assert s["graph_fused_vs_compiled_heads"] == pytest.approx(1.1)
    assert s["graph_compiled_vs_torch_heads"] == pytest.approx(3.0 / 2.75)
    assert s["eager_erase_vs_seq_paired"] == 1.02 and s["eager_again_vs_seq_paired"] == 0.99
    assert s["eager_erase_vs_seq_wall"] == 1.01 and s["eager_always_fork_vs_seq_wall"] == 0.93
    assert "eager_again_vs_seq_wall" not in s  # a row without wall blocks adds no wall column
    assert s["graph_early_vs_erase"] == pytest.approx(2.5 / 2.4) and s["graph_early_vs_e2e"] == pytest.approx(3.3 / 2.4)
    assert s["graph_fused_vs_torch_heads_early"] == pytest.approx(2.9 / 2.4)


@pytest.mark.parametrize("relu_in_head", [False, True])
def test_free_heads_replayed_gradient(relu_in_head):
    # FreeHead(free_grad="replayed"): the first call back-propagates the gradient a real head computes
    # (at the ReLU's input with the ReLU in the head), later calls the same stored gradient, whatever
    # their targets; the heads get no grads.
    from erase_triton.models import MLPChain
    from erase_triton.bench import free_heads, with_heads
    torch.manual_seed(0)
    model = MLPChain(16, blocks=3, relu_in_head=relu_in_head)
    ref = MLPChain(16, blocks=3, relu_in_head=relu_in_head)
    ref.load_state_dict(model.state_dict())
    free_heads(model, "replayed")
    x, y = torch.randn(8, 16), torch.rand(8).round()
    with Scheduler("erase").step():
        model(x, y)
    assert all(hd.weight.grad is None and hd.bias.grad is None for hd in model.heads)
    with Scheduler("sequential").step():
        ref(x, y)
    for (k, p), q in zip(model.blocks.named_parameters(), ref.blocks.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=k)
    first = [p.grad.clone() for p in model.blocks.parameters()]
    model.zero_grad(set_to_none=True)
    with Scheduler("erase").step():
        model(x, 1 - y)  # other targets: the stored gradient is replayed, not recomputed
    for p, g in zip(model.blocks.parameters(), first):
        torch.testing.assert_close(p.grad, g)
    with pytest.raises(ValueError, match="free_grad must be"):
        free_heads(model, "zero")
    with pytest.raises(ValueError, match="heads must be one of"):
        with_heads(lambda **kw: None, "free-random")


def test_mlp_relu_in_head_same_function_and_free_bound():
    # MLPChain(relu_in_head=True) computes what MLPChain computes (the block's last ReLU now
    # in the head), trains to the same gradients, and its FreeHead sends the constant gradient
    # to the ReLU's input, as the fused head does
    from erase_triton.models import MLPChain
    from erase_triton.bench import free_heads
    torch.manual_seed(0)
    plain = MLPChain(16, blocks=3)
    torch.manual_seed(0)
    fused = MLPChain(16, blocks=3, relu_in_head=True)
    assert len(fused.blocks[0]) == len(plain.blocks[0]) - 1
    x, y = torch.randn(8, 16), torch.rand(8).round()
    torch.testing.assert_close(fused.predict(x), plain.predict(x))
    for mode in ("sequential", "erase", "e2e"):
        assert_same_grads(run(fused, mode, x, y)[0], run(plain, mode, x, y)[0])
    free_heads(fused)
    fused.zero_grad(set_to_none=True)
    with Scheduler("erase").step():
        out = fused(x, y)
    h = x
    for blk in plain.blocks[:-1]:
        h = blk(h).detach()
    torch.testing.assert_close(out, plain.blocks[-1](h).detach())  # relu(pre-activation): the block's output
    plain.zero_grad(set_to_none=True)
    h = x
    for blk in plain.blocks:
        pre = blk[:-1](h)
        pre.backward(torch.full_like(pre, 1e-4))  # the constant skips the ReLU
        h = blk[-1](pre).detach()
    for (k, p), q in zip(fused.blocks.named_parameters(), plain.blocks.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=k)


def recording_aot_eager(graphs: list):
    """A torch.compile backend: AOTAutograd without Inductor (no C++ compiler needed), appending
    every graph Dynamo hands it to `graphs`."""
    from torch._dynamo.backends.registry import lookup_backend

    aot_eager = lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)
    return backend


@pytest.mark.parametrize("loss,activation", [("bce", None), ("ce", None), ("bce", "relu")])
def test_compiled_blocks_keep_the_schedule(loss, activation):
    # compile_blocks compiles each block between two heads (here with AOTAutograd and no Inductor:
    # the same autograd structure, a compiled forward and a compiled backward a block, without a
    # C++ compiler) and the three modes keep their math: erase == sequential == the detached
    # reference, e2e == autograd; no head is traced, and no mode recompiles what another compiled.
    from erase_triton import compile_blocks

    graphs = []
    recording = recording_aot_eager(graphs)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Chain(loss=loss, activation=activation)
    ref = copy.deepcopy(model)
    x, y = data(loss)
    assert compile_blocks(model, backend=recording) == [f"blocks.{i}" for i in range(4)]
    counts = {}
    try:
        want = {"erase": detached_reference(ref, x, y)}
        want["sequential"] = want["erase"]
        ref.zero_grad(set_to_none=True)
        want["e2e"] = e2e_reference(ref, x, y)
        for mode in ("sequential", "erase", "e2e"):
            for _ in range(2):
                got, sched = run(model, mode, x, y)
                assert_same_grads(got, want[mode])
            assert sched.last_trace == run(ref, mode, x, y)[1].last_trace
            counts[mode] = len(graphs)
        # one graph for the four like blocks; erase reuses sequential's; e2e's blocks take inputs that
        # require grad (nothing is detached), which is another graph, once
        assert counts == {"sequential": 1, "erase": 1, "e2e": 2}, counts
        for gm in graphs:
            assert "head" not in gm.code and "backward" not in gm.code, gm.code
    finally:
        torch._dynamo.reset()


def test_compile_blocks_finds_the_blocks_between_heads():
    from erase_triton import compile_blocks
    from erase_triton.models import MLPChain
    from erase_triton.bench import ctr_workload, transformer_workload

    with torch._dynamo.config.patch(disable=True):  # nothing is compiled when called
        mlp = MLPChain(16, blocks=3)
        assert compile_blocks(mlp) == ["blocks.0", "blocks.1", "blocks.2"]
        tf, _ = transformer_workload(32, 2, 8, device="cpu", dtype=torch.float32)
        assert compile_blocks(tf) == ["tok", "pos"] + [f"layers.{i}" for i in range(6)] + ["ln_f"]
        ctr, _ = ctr_workload(32, 8, rows=10, tables=2, device="cpu")
        assert compile_blocks(ctr) == ["embeddings", "bottom", "proj"] + [f"subarchs.{i}" for i in range(6)] + ["over"]
        assert not any(m._compiled_call_impl is not None for m in tf.modules() if isinstance(m, LocalHead))
        assert tf.layers[0]._compiled_call_impl is not None and tf.layers[0].ln1._compiled_call_impl is None
        shared = nn.Linear(4, 4)
        assert compile_blocks(nn.Sequential(shared, shared)) == [""]  # no head: the model itself
        head_only = nn.ModuleList([LocalHead(4, 1), LocalHead(4, 1, final=True)])
        assert compile_blocks(head_only) == []
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        compile_blocks(lambda x: x)


def test_compile_blocks_calls_keep_their_own_graphs():
    # Dynamo caches graphs per code object: each compile_blocks call gets its own, so a second
    # model with other shapes neither reuses nor evicts the first model's graphs
    from erase_triton import compile_blocks

    graphs = []
    recording = recording_aot_eager(graphs)

    torch._dynamo.reset()
    try:
        models = [nn.Sequential(nn.Linear(d, d), nn.ReLU()) for d in (8, 8, 12)]
        for m in models:
            compile_blocks(m, backend=recording)
        xs = [torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 12)]
        for m, x in zip(models, xs):
            torch.testing.assert_close(m(x), m._call_impl(x))
        assert len(graphs) == 3  # one a call, though the first two models are alike
        codes = {id(m._compiled_call_impl.func._torchdynamo_orig_callable.__code__) for m in models}  # equal by value
        assert len(codes) == 3
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("relu_in_head", [False, True])
def test_compiled_torch_heads_equal_torch_heads(monkeypatch, relu_in_head):
    # CompiledTorchHead (the compiled-PyTorch-head baseline of bench_schedule --compiled-heads)
    # trains exactly as PyTorch heads do; compiled here by AOTAutograd without Inductor
    from erase_triton import bench as study
    from erase_triton.bench import heads as bench_heads

    compiled = torch.compile(reference.linear_head_loss, backend="aot_eager", dynamic=False)
    monkeypatch.setattr(bench_heads, "_compiled_torch_head_loss", lambda: compiled)
    torch._dynamo.reset()
    try:
        got = {}
        for heads in ("torch", "torch-compile"):
            model, (x, y) = study.with_heads(study.mlp_workload, heads, 16, 8, torch.float32, device="cpu",
                                             relu_in_head=relu_in_head)
            assert all(type(h) is (study.CompiledTorchHead if heads == "torch-compile" else LocalHead)
                       for h in model.heads)
            for mode in ("erase", "e2e"):
                got[heads, mode] = run(model, mode, x, y)[0]
                assert model.heads[-1].last_loss is not None
        for mode in ("erase", "e2e"):
            assert_same_grads(got["torch-compile", mode], got["torch", mode])
    finally:
        torch._dynamo.reset()
    model, (x, y) = study.with_heads(study.mlp_workload, "torch-compile", 16, 8, torch.float32, device="cpu")
    with pytest.raises(ValueError):  # the PyTorch heads' argument checks
        run(model, "erase", x, y[:3])


def _two_group_adamw(model):
    """AdamW with the heads in their own group (another lr, no weight decay)."""
    heads = [p for n, p in model.named_parameters() if n.startswith("heads.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("heads.")]
    return torch.optim.AdamW([{"params": rest}, {"params": heads, "lr": 3e-2, "weight_decay": 0.0}], lr=1e-2)


@pytest.mark.parametrize("mode", ["sequential", "erase", "e2e"])
@pytest.mark.parametrize("make_opt", [lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                      _two_group_adamw], ids=["sgd-momentum", "adamw-2-groups"])
@pytest.mark.parametrize("share", [False, True])
def test_early_updates_equal_stepping_after(mode, make_opt, share):
    # Scheduler(optimizer=) updates each segment's parameters right after its backward: the
    # same training as opt.step() after the step, bit for bit; the first step updates at exit
    # (nothing learned yet), later erase steps after each segment (a shared parameter after the
    # last segment reaching it), sequential and e2e always at exit
    torch.manual_seed(3)
    a = Chain(share=share)
    b = copy.deepcopy(a)
    c = copy.deepcopy(a)  # PyTorch heads: the training itself is right, not only equal between a and b
    for hd in c.heads:
        hd.backend = "torch"
    x, y = data("bce")
    oa, ob = make_opt(a), make_opt(b)
    sa, sb = Scheduler(mode, optimizer=oa), Scheduler(mode)
    for i in range(4):
        oa.zero_grad(set_to_none=True)
        ob.zero_grad(set_to_none=True)
        with sa.step():
            a(x, y)
        with sb.step():
            b(x, y)
        ob.step()
        if i == 0:  # (later steps: Adam turns rounding-size gradient differences into lr-size ones)
            with Scheduler(mode).step():
                c(x, y)
            for (k, p), q in zip(a.named_parameters(), c.parameters()):
                assert (p.grad is None) == (q.grad is None), k
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
        updates = [e[1:] for e in sa.last_trace if e[0] == "update"]
        n = sum(1 for g in oa.param_groups for _ in g["params"])
        if i == 0 or mode != "erase":
            assert updates == [("exit", n)], sa.last_trace
        else:  # four segments of 6 parameters (block 2 + 2 head); with share, block 0's first layer moves to 2
            assert updates == ([(0, 4), (1, 6), (2, 6), (3, 6)] if share else [(j, 6) for j in range(4)])
        for (k, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), (i, k)


def _early_erase(model, x, y, steps=2):
    """An erase Scheduler stepping model's SGD (early updates) after `steps` steps on (x, y)."""
    sched = Scheduler("erase", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(steps):
        with sched.step():
            model(x, y)
    return sched


def test_early_updates_refuse_a_segment_reaching_an_updated_parameter():
    torch.manual_seed(0)
    model = Chain()
    x, y = data("bce")
    sched = _early_erase(model, x, y)
    # segment 1 gets a new head and block 0's first layer, which the plan updates after segment 0
    model.heads[1] = LocalHead(24, 3, "bce")
    model.blocks[1][0] = model.blocks[0][0]
    with pytest.raises(RuntimeError, match="segment 1's backward reaches 2 parameter.*already updated"):
        with sched.step():
            model(x, y)
    # the same change with the old head: found only after reset() (each segment's leaves are
    # found once); then learned anew, the shared layer updated after segment 2
    model = Chain()
    sched = _early_erase(model, x, y)
    model.blocks[2][0] = model.blocks[0][0]
    sched.reset()
    for _ in range(2):
        with sched.step():
            model(x, y)
    # ("exit", 2): block 2's replaced layer, still in the optimizer, reached by no segment
    assert [e[1:] for e in sched.last_trace if e[0] == "update"] == [(0, 4), (1, 6), (2, 6), (3, 6), ("exit", 2)]


def test_early_updates_relearn_and_own_the_optimizer():
    torch.manual_seed(0)
    model = Chain(n=3)
    x, y = data("bce")
    sched = _early_erase(model, x, y)
    opt = sched.optimizer
    with pytest.raises(RuntimeError, match="stepped by a Scheduler"):
        opt.step()  # would apply the update twice
    # a new parameter group: the plan is learned again (this step updates at exit)
    extra = nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra]})
    with sched.step():
        model(x, y)
    assert [e[1] for e in sched.last_trace if e[0] == "update"] == ["exit"]
    with sched.step():
        model(x, y)
    assert [e[1:] for e in sched.last_trace if e[0] == "update"] == [(0, 6), (1, 6), (2, 6), ("exit", 1)]
    # an exception inside the step: the segments before it were updated, nothing at exit
    with pytest.raises(ValueError, match="boom"):
        with sched.step():
            model(x, y)
            raise ValueError("boom")
    assert ("update", "exit", 1) not in sched.last_trace
    sched.optimizer = None  # released: the user steps it again
    opt.step()
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        Scheduler(optimizer="sgd")
    with pytest.raises(ValueError, match="LBFGS"):
        Scheduler(optimizer=torch.optim.LBFGS(model.parameters()))
    with pytest.raises(RuntimeError, match="cannot change inside step"):
        with sched.step():
            sched.optimizer = opt


def test_plan_detach_point_decides_fork_waits_join_and_update():
    # the pure rule the executor carries out: which detach points fork, what they wait on, where
    # the caller joins, and which early update follows the backward
    from erase_triton.scheduler import plan_detach_point
    ring = RingPlan(3)
    seq = plan_detach_point(2, mode="sequential", host_bound=False, final=False, stream=0, ring=ring)
    assert (seq.on_ring, seq.fork, seq.stream, seq.trace()) == (False, False, 0, [("bwd", 2, 0, ())])
    host = plan_detach_point(0, mode="erase", host_bound=True, final=False, stream=0, ring=ring)
    assert (host.on_ring, host.stream, host.next_stream) == (False, "caller", "caller")
    a, b = frozenset({1, 2}), frozenset({2, 3})
    p = plan_detach_point(1, mode="erase", host_bound=False, final=False, stream=1, ring=ring, leaves=b,
                          earlier={0: (0, a)}, update=[["w"]])
    assert (p.on_ring, p.fork, p.next_stream, p.wait_for, p.join, p.update) == (True, True, 2, (0,), False, [["w"]])
    assert p.trace() == [("bwd", 1, 1, (0,)), ("fwd", 2, 2)]
    # the ring wraps; a ring of one stream never forks; the final head joins and does not fork
    assert plan_detach_point(2, mode="erase", host_bound=False, final=False, stream=2, ring=ring).next_stream == 0
    one = plan_detach_point(0, mode="erase", host_bound=False, final=False, stream=0, ring=RingPlan(1))
    assert (one.fork, one.next_stream) == (False, 0)
    fin = plan_detach_point(3, mode="erase", host_bound=False, final=True, stream=0, ring=ring)
    assert (fin.fork, fin.join, fin.next_stream) == (False, True, "caller")
    # no wait on an earlier segment of the same stream (already ordered) or with other leaves
    assert plan_detach_point(1, mode="erase", host_bound=False, final=False, stream=0, ring=ring, leaves=b,
                             earlier={0: (0, a)}).wait_for == ()


@pytest.mark.parametrize("nested", [False, True])
def test_capture_runs_warmup_then_one_step_and_accepts_a_step_fn_that_opens_it(monkeypatch, nested):
    # Scheduler.capture on fake CUDA (the graph runs eagerly): `warmup` real steps, then the captured
    # one, every one forking; a step_fn that opens `with sched.step():` itself is the same step
    from fake_cuda import fake_graphs
    torch.manual_seed(0)
    model = Chain()
    for hd in model.heads:
        hd.backend = "torch"
    x, y = data("bce")
    log = _fake_cuda(monkeypatch, lambda name: True)
    fake_graphs(monkeypatch, log)
    sched = Scheduler("erase")
    calls = []

    def step_fn(x, y):
        calls.append(1)
        if nested:
            with sched.step():
                model(x, y)
        else:
            model(x, y)
        return sched.last_forks
    replay = sched.capture(step_fn, x, y, warmup=3)
    assert len(calls) == 4 and replay.out == len(model.heads) - 1  # 3 warm-up steps + the captured one
    replay()
    assert replay.graph.replays == 1
    with pytest.raises(RuntimeError, match="not re-entrant"):  # outside capture, a nested step still is an error
        with sched.step():
            with sched.step():
                pass


def _graphs_alive(model) -> int:
    """Tensors alive with a grad_fn whose graph reaches model's parameters (its AccumulateGrad nodes)."""
    gc.collect()
    params, n = {id(p) for p in model.parameters()}, 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.grad_fn is not None:
            todo, seen = [o.grad_fn], set()
            while todo:
                f = todo.pop()
                if f is None or f in seen:
                    continue
                seen.add(f)
                if id(getattr(f, "variable", None)) in params:
                    n += 1
                    break
                todo.extend(g for g, _ in f.next_functions)
    return n


@pytest.mark.parametrize("embedding,plant", [("fused_sgd", False), ("table", False), ("fused_sgd", True)])
def test_no_autograd_graph_outlives_a_step(monkeypatch, embedding, plant):
    # An AccumulateGrad node records the stream it was made on; kept alive into the next step (by any
    # tensor of the last step's graph), the next step's backward on another ring stream meets it there:
    # PyTorch's "AccumulateGrad node's stream does not match" warning, and a cross-stream sync. Capture's
    # warm-up steps on the fake-stream ring (every detach point forks) and the captured step must each
    # start with no graph alive. plant: a step_fn that keeps its block's output, which the check must see.
    from fake_cuda import fake_graphs
    from erase_triton.bench import ctr_workload
    from erase_triton.train import training_step
    model, inputs = ctr_workload(32, 64, tables=3, rows=50, emb_dim=8, device="cpu", embedding=embedding)
    step = training_step(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    fake_graphs(monkeypatch, _fake_cuda(monkeypatch, lambda name: True))
    sched, alive, kept = Scheduler("erase"), [], []

    def step_fn(*xs):
        alive.append(_graphs_alive(model))
        if plant:
            kept.append(model.subarchs[0](model.features(xs[0], xs[1])))
        step(*xs)
    sched.capture(step_fn, *inputs, warmup=3)
    assert sched.last_forks == len(model.heads)
    if plant:  # (the kept output and the tensors its graph saved)
        assert alive[0] == 0 and min(alive[1:]) > 0, alive
    else:
        assert alive == [0, 0, 0, 0]  # 3 warm-up steps and the captured one
