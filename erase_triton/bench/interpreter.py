"""Triton's CPU interpreter made to round as the GPU does, for studies and tests that read 16-bit outputs."""
from __future__ import annotations

import torch

__all__ = ["round_bf16_like_the_gpu"]


def round_bf16_like_the_gpu() -> None:
    """The interpreter (triton 3.6) casts fp32 to bf16 by truncation, where the GPU's cvt.rn rounds to
    nearest even: a bias of -0.3% on every bf16 value a kernel writes. This makes it round as the GPU does
    (a patch of the interpreter's conversion; idempotent), so bf16 errors measure the kernels and not the
    interpreter. Call it where TRITON_INTERPRET=1, before the kernels run."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter._convert_float
    if getattr(real, "rounds_to_nearest", False):
        return

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and \
                rounding_mode in (None, interpreter._ir.ROUNDING_MODE.RTNE):
            x = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(input.shape)
        return real(input, input_dtype, output_dtype, rounding_mode)
    convert.rounds_to_nearest = True
    interpreter._convert_float = convert
