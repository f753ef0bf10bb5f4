# The interpreter flag is read when @triton.jit runs: set it before any kernel import.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


if os.environ.get("TRITON_INTERPRET") == "1":
    # the interpreter truncates fp32 to bf16 (a -0.3% bias on every bf16 output); the GPU rounds to nearest even
    from erase_triton.bench.interpreter import round_bf16_like_the_gpu

    round_bf16_like_the_gpu()

import pytest  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # the tests' helper modules (fake_cuda, dp_cases)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    if not torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _planted_error(monkeypatch):
    """ERASE_TRITON_PLANT=OUTPUT (loss, grad_h, grad_weight or grad_bias): every Triton head call returns
    that output 2% too large. The equality tests must then fail: `ERASE_TRITON_PLANT=grad_h pytest ...`
    shows that they can."""
    out = os.environ.get("ERASE_TRITON_PLANT")
    if not out:
        return
    import erase_triton.functional as functional

    real = functional.local_head_into

    def planted(*a, **kw):
        loss, grad_h = real(*a, **kw)
        if not functional.use_triton(a[0], kw["backend"]):
            return loss, grad_h
        if out in ("grad_weight", "grad_bias") and kw[out] is not None:
            kw[out].mul_(1.02)
        return (loss * 1.02 if out == "loss" else loss), (grad_h * 1.02 if out == "grad_h" else grad_h)
    import erase_triton.head as head

    monkeypatch.setattr(functional, "local_head_into", planted)
    monkeypatch.setattr(head, "local_head_into", planted)
