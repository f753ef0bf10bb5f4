"""Accuracy of the dense head's whole-row tiles at D=2048 on the GPU, per launch variant.

    python benchmarks/check_wide_rows.py

Prints, for BCE C=1 N=16384 D=2048 fp32, each variant's relative error (loss, grad_h, grad_W,
grad_b) against float64 next to PyTorch's own fp32 error: the tile rule's choices (2 rows on 4
warps, 4 rows on 2 warps) against the D-chunked kernel, in atomic and fixed-order modes.
"""
import torch

import erase_triton as et
from erase_triton import fused_local_head, reference

dev = "cuda"
N, D = 16384, 2048
print("allow_tf32", torch.backends.cuda.matmul.allow_tf32)
g = torch.Generator(device=dev).manual_seed(0)
h = torch.randn(N, D, device=dev, generator=g)
w = torch.randn(1, D, device=dev, generator=g) / D ** 0.5
b = torch.randn(1, device=dev, generator=g) * 0.1
y = torch.rand(N, 1, device=dev, generator=g).round()
rel = lambda o, r: ((o.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item()  # noqa: E731
same = reference.local_head(h, w, b, y, loss="bce")
ref = reference.local_head(h.double(), w.double(), b.double(), y.double(), loss="bce")
print("torch", ["%.2g" % rel(s, r) for s, r in zip(same, ref)])
for name, kw in [("default", {}), ("bn2 nw4 st1", dict(block_n=2, num_warps=4, num_stages=1)),
                 ("bn4 nw2 st2", dict(block_n=4, num_warps=2, num_stages=2)),
                 ("chunked bd128", dict(block_d=128)), ("bn2 nw2 st1", dict(block_n=2, num_warps=2, num_stages=1))]:
    for det in (False, True):
        out = fused_local_head(h, w, b, y, loss="bce", config=et.LaunchConfig(deterministic=det, **kw))
        print(f"{name:14s} det={det!s:5s}", ["%.2g" % rel(o, r) for o, r in zip(out, ref)], flush=True)
