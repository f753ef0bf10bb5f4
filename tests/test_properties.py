"""Property-based tests: fused_local_head against the float64 reference over random shapes, dtypes,
losses, reductions, ignore_index patterns and non-contiguous inputs, every vocabulary path, and launch
settings with the ReLU taken over and fp32 weights beside 16-bit h (the three-way rule of
tests/head_checks.py). Seeded and bounded to keep CI fast; under the interpreter on a CPU."""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from erase_triton import LaunchConfig, fused_local_head, reference
from head_checks import DTYPES, assert_three_way

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="needs the Triton interpreter or a GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@st.composite
def head_case(draw, vocab=None):
    """vocab: a vocabulary path (C > 512 and that LaunchConfig.vocab_path), or None: any head."""
    loss = "ce" if vocab else draw(st.sampled_from(["bce", "mse", "ce"]))
    C = draw(st.integers(513, 1300) if vocab else st.integers(2, 80) if loss == "ce" else st.integers(1, 8))
    N = draw(st.integers(1, 300 if vocab else 70))
    D = draw(st.integers(1, 70))
    cfg = {}
    if vocab:  # the path, chunk sizes from one tile to the whole, part of the grid
        cfg = dict(vocab_path=vocab,
                   chunk_size=draw(st.one_of(st.none(), st.integers(1, 1400))),
                   occupancy=draw(st.sampled_from([None, 0.25, 0.5])))
        if vocab == "cublas":  # the rule's form, or the row read twice in blocks of block_v columns
            two_pass = draw(st.sampled_from([None, True]))
            cfg.update(two_pass=two_pass, block_v=draw(st.sampled_from([16, 128, 512])) if two_pass else None)
    cublas = str(cfg.get("vocab_path")).startswith("cublas")
    dtypes = ["fp32", "bf16"] if cublas else list(DTYPES)  # (the cublas paths refuse fp16)
    return dict(loss=loss, N=N, D=D, C=C, config=cfg, dtype=draw(st.sampled_from(dtypes)),
                reduction=draw(st.sampled_from(["mean", "sum"])), bias=draw(st.booleans()),
                layout=draw(st.sampled_from(["contiguous", "transposed", "strided"])),
                ignore=draw(st.sampled_from(["none", "some", "all-but-one"])) if loss == "ce" else "none",
                ignore_index=draw(st.sampled_from([-100, -1, 0])) if loss == "ce" else -100,
                seed=draw(st.integers(0, 2 ** 16)))


def _inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    N, D, C, dt = c["N"], c["D"], c["C"], DTYPES[c["dtype"]]
    h = torch.randn(N, D, generator=g)
    if c["layout"] == "transposed":  # a [N, D] view of a [D, N] tensor: no unit stride along D
        h = h.t().contiguous().t()
    elif c["layout"] == "strided":  # every other row of a taller tensor
        h = torch.randn(2 * N, D, generator=g)[::2]
    w = torch.randn(C, D, generator=g) / max(D, 1) ** 0.5
    b = torch.randn(C, generator=g) * 0.1 if c["bias"] else None
    if c["loss"] == "ce":
        ii = c["ignore_index"]
        y = torch.randint(0, C, (N,), generator=g)
        if ii >= 0:  # an ignore_index inside [0, C): rows of that class are skipped
            y[y == ii] = (ii + 1) % C
        if c["ignore"] == "some":
            y[1::3] = ii
        elif c["ignore"] == "all-but-one":
            y[1:] = ii
    elif c["loss"] == "bce":
        y = torch.rand(N, C, generator=g).round()
    else:
        y = torch.randn(N, C, generator=g)
    mv = lambda t, d=None: t.to(DEVICE, d) if t is not None else None  # noqa: E731
    return mv(h.to(dt)), mv(w, dt), mv(b, dt), mv(y)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(head_case())
def test_fused_head_matches_float64_reference(c):
    check_case(c)


@pytest.mark.parametrize("path", ["recompute", "vocab_chunks", "row_chunks", "cublas", "cublas_vocab_chunks"])
def test_vocabulary_paths_match_float64_reference(path):
    # each path its own draws (one sampled path got 1 of 24 examples under derandomize)
    @settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(head_case(vocab=path))
    def run(c):
        check_case(c)
    run()


@st.composite
def launch_case(draw):
    """A dense or small-CE head with drawn launch settings, a ReLU taken over or not, and a weight
    in h's dtype or in fp32 (autocast's parameters)."""
    c = draw(head_case())
    cfg = dict(occupancy=draw(st.sampled_from([None, 1 / 32, 0.125, 0.5])),
               deterministic=draw(st.sampled_from([None, True, False])),
               group_tiles=draw(st.sampled_from([None, 1, 3])), block_n=draw(st.sampled_from([None, 16, 64])),
               num_stages=draw(st.sampled_from([None, 1, 3])))
    if c["C"] == 1 and c["loss"] != "ce" and cfg["deterministic"] is False and cfg["group_tiles"] is None:
        cfg["two_pass"] = draw(st.sampled_from([None, True]))  # (the atomic C = 1 kernel only)
    c.update(config=cfg, activation=draw(st.sampled_from([None, "relu"])),
             wdtype=draw(st.sampled_from([c["dtype"], "fp32"])))
    return c


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(launch_case())
def test_launch_settings_match_float64_reference(c):
    check_case(c)


def check_case(c):
    h, w, b, y = _inputs(c)
    if c.get("wdtype"):  # the parameters in another dtype than h (they enter the products in h's)
        w, b = (t.to(DTYPES[c["wdtype"]]) if t is not None else None for t in (w, b))
    kw = dict(loss=c["loss"], reduction=c["reduction"], ignore_index=c["ignore_index"], activation=c.get("activation"))
    out = fused_local_head(h, w, b, y, backend="triton", config=LaunchConfig(**c["config"]), **kw)
    same = reference.local_head(h, w, b, y, **kw)
    f64 = lambda t: t.double() if t is not None else None  # noqa: E731
    ref = reference.local_head(f64(h), f64(w.to(h.dtype)), f64(b.to(h.dtype)) if b is not None else None,
                               y if c["loss"] == "ce" else f64(y), **kw)
    dt = DTYPES[c["dtype"]]
    assert_three_way(out.loss, same.loss, ref.loss, dt, "loss")
    assert_three_way(out.grad_h, same.grad_h, ref.grad_h, dt, "grad_h")
    assert_three_way(out.grad_weight, same.grad_weight, ref.grad_weight, dt, "grad_weight")
    if c["bias"]:
        assert_three_way(out.grad_bias, same.grad_bias, ref.grad_bias, dt, "grad_bias")
    assert out.grad_h.shape == h.shape and out.grad_h.is_contiguous()
