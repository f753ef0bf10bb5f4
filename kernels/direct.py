"""Triton kernels launched through their compiled launcher, skipping `kernel[grid](...)`'s generic dispatch.

The generic dispatch binds the arguments, hashes their specialisation and queries the driver for each
pointer on every call: more host time than a small kernel runs. A launch whose arguments keep their
dtypes, 16-byte alignment and integer specialisation from call to call (a prepared head call) can be
compiled once, at preparation, and then handed straight to the C launcher. Triton's launch hooks
(`knobs.runtime.launch_enter_hook`, used by proton) are not called for such launches.
"""
from __future__ import annotations

import torch

__all__ = ["KernelLaunch", "direct_launcher"]


def direct_launcher(compiled) -> tuple:
    """(raw, function, packed, coop, pdl) for `raw(gx, gy, gz, stream, function, coop, pdl, None, None, packed,
    None, None, None, *args)`. Triton's CudaLauncher.__call__ only allocates scratch (none for our kernels)
    before it forwards to the C `launch`: call that directly when nothing else is needed, else __call__."""
    launcher = compiled.run  # loads the binary on first use
    plain = (getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0
             and hasattr(launcher, "launch"))
    if plain:
        return (launcher.launch, compiled.function, compiled.packed_metadata, launcher.launch_cooperative_grid,
                launcher.launch_pdl)

    def raw(gx, gy, gz, stream, function, _coop, _pdl, _gs, _ps, packed, *rest):
        launcher(gx, gy, gz, stream, function, packed, *rest)
    return raw, compiled.function, compiled.packed_metadata, None, None


class KernelLaunch:
    """One Triton kernel with its grid (programs, or a tuple of up to 3 dimensions) and launch keywords
    (constexprs, num_warps) fixed, called as `launch(stream, *args)` with the kernel's other arguments in
    order (tensors, ints).

    With `example` (CUDA): the kernel is compiled for arguments like these (tensors, or a torch dtype
    for a library-allocated, 16-byte aligned buffer; the same integers) and every call goes straight
    to its launcher, with each tensor's data_ptr(): a call whose arguments differ from the example in
    alignment or integer specialisation would run the wrong binary, so only a prepared launch, whose
    signature fixes them, may use it. Without (the CPU interpreter): `kernel[grid](*args, **constexprs)`.
    """

    __slots__ = ("kernel", "name", "grid", "cx", "raw", "function", "packed", "coop", "pdl", "tail")

    def __init__(self, kernel, grid: int | tuple, cx: dict, example: tuple | None = None, arity: int | None = None):
        # cx: the launch keywords, the constexprs and num_warps; arity: the other arguments' count, checked
        # (the example's, where there is one)
        grid = (grid,) if isinstance(grid, int) else tuple(grid)
        self.kernel, self.grid, self.cx = kernel, grid + (1,) * (3 - len(grid)), cx
        self.name = getattr(kernel, "__name__", None) or kernel.fn.__name__
        self.raw = None
        names = [k for k in cx if k != "num_warps"]
        # the constexprs follow the other parameters in our kernels (checked on the CPU too): the direct launch
        # passes them (ignored) in the kernel's order, whatever cx's
        tail = list(kernel.arg_names[len(kernel.arg_names) - len(names):])
        if sorted(tail) != sorted(names):
            raise ValueError(f"{self.name}: cx {names} are not the kernel's last parameters {list(kernel.arg_names)}")
        self.tail = tuple(cx[k] for k in tail)
        arity = len(example) if example is not None else arity
        if arity is not None and arity + len(names) != len(kernel.arg_names):
            raise ValueError(f"{self.name}: {arity} arguments and cx {names}, but its parameters are "
                             f"{list(kernel.arg_names)}")
        if example is not None:
            compiled = kernel.warmup(*example, grid=self.grid, **cx)
            self.raw, self.function, self.packed, self.coop, self.pdl = direct_launcher(compiled)

    def __call__(self, stream, *args):
        if self.raw is None:
            self.kernel[self.grid](*args, **self.cx)
        else:
            self.raw(*self.grid, stream, self.function, self.coop, self.pdl, None, None, self.packed, None, None,
                     None, *[a.data_ptr() if type(a) is torch.Tensor else a for a in args], *self.tail)
