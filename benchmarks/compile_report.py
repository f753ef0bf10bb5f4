"""Registers, spills, shared memory and MMA version of a fused-head kernel for sm_90a, without a GPU.

    python benchmarks/compile_report.py --loss ce --C 256 --D 512 [--dtype bf16] [--wdtype fp32] [--set BLOCK_N=32 ...]
    python benchmarks/compile_report.py --C 32000 --D 512 --vocab-path row_chunks [--ptx k.ptx]
    python benchmarks/compile_report.py --D 512 --lse-gemm   (cublas_vocab_chunks' Gluon pass 1 on Hopper)
    python benchmarks/compile_report.py --dz [--no-bias] [--set STAGES=3]   (cublas_vocab_chunks' dz kernel)

Builds the launch plan the library would build for a CUDA tensor of that shape (same
constexprs, same num_warps), compiles it with Triton for an H100/H200 target and runs
the bundled ptxas with -v. Spills, the MMA version (3 = wgmma) and async copies (pipelined loads) decide whether a tile
set is worth a GPU minute. --set overrides constexprs of the plan (and num_warps, maxnreg, num_stages).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the device, not the interpreter

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile  # noqa: E402

from erase_triton.kernels import launch as kl  # noqa: E402
from erase_triton.kernels import plan as kplan  # noqa: E402

_DT = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
# pointer arguments: which dtype each points to (h-like ones follow --dtype, w-like ones --wdtype)
_PTRS = {"z_ptr": "h", "t_ptr": "h", "g_ptr": "h", "scale_ptr": "fp32", "h_ptr": "h", "w_ptr": "w", "b_ptr": "w", "y_ptr": "i64", "gh_ptr": "h", "act_ptr": "h", "gw_ptr": "w", "gb_ptr": "w",
         "loss_ptr": "fp32", "lse_ptr": "fp32", "colsum_ptr": "fp32", "grad_bias_ptr": "w", "rows_loss_ptr": "fp32", "out_ptr": "fp32", "part_ptr": "fp32", "ws_ptr": "fp32", "acc_ptr": "fp32", "ctr_ptr": "i32"}
_INTS = {"inv_count": "fp32"}


def plan_constexprs(loss, C, D, dtype, occupancy, deterministic, vocab_path=None):
    import torch
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    cfg = kl.LaunchConfig(occupancy=occupancy, deterministic=deterministic, vocab_path=vocab_path)
    if vocab_path == "cublas" and loss == "ce" and C > kplan.SMALL_CE_MAX_C:  # the Triton kernel between its GEMMs
        from erase_triton.kernels.vocab_ce_cublas import first_kernel, row_lse_kernel
        cx = first_kernel(C, True, True, True)[1]  # (with a bias: row_lse_kernel)
        return kplan._Plan(row_lse_kernel, "cublas", cx, cx.pop("num_warps"))
    if vocab_path == "cublas_vocab_chunks" and loss == "ce" and C > kplan.SMALL_CE_MAX_C:  # its lse kernel, last chunk
        from erase_triton.kernels.vocab_ce_cublas import LSE_WARPS
        from erase_triton.kernels.vocab_ce_cublas_vocab_chunks import CublasVocabLaunch, chunk_lse_kernel
        hl = CublasVocabLaunch(4096, C, C, True, -100, False, False, True, torch.device("cpu"))
        return kplan._Plan(chunk_lse_kernel, vocab_path, dict(hl.constexprs, FIRST=False, LAST=True), LSE_WARPS)
    if vocab_path == "cublas_in_place" and loss == "ce" and C > kplan.SMALL_CE_MAX_C:  # its lse kernel
        from erase_triton.kernels.vocab_ce_cublas_in_place import LSE_T_WARPS, CublasInPlaceLaunch, lse_t_kernel
        hl = CublasInPlaceLaunch(min(D, 4096), C, D, kplan.CUBLAS_IN_PLACE_BLOCK, True, -100, False, True,
                                 torch.device("cpu"))
        return kplan._Plan(lse_t_kernel, vocab_path, hl.constexprs, LSE_T_WARPS)
    precision = "tf32" if dtype == "fp32" else "ieee"
    plan = kplan.plan_for(loss, "mean", C, D, tdt, True, False, cfg, True, False, precision, deterministic)
    return plan


def report(plan, dtype, overrides: dict, ints: dict, arch: int = 90, wdtype: str | None = None,
           ptx: str | None = None) -> dict:
    cx = dict(plan.constexprs)
    warps = int(overrides.pop("num_warps", plan.num_warps))
    opts = {k: v for k, v in plan.opts.items() if k != "num_warps"}  # the plan's maxnreg and num_stages, then --set's
    opts.update({k: int(overrides.pop(k)) for k in ("maxnreg", "num_stages") if k in overrides})
    for k, v in overrides.items():
        cx[k] = type(cx[k])(v) if not isinstance(cx[k], bool) else v in ("1", "True", "true")
    fn = plan.kernel
    sig = {}
    for name in fn.arg_names:
        if name in cx:
            sig[name] = "constexpr"
        elif name in _PTRS:
            t = _PTRS[name]
            sig[name] = "*" + {"h": _DT[dtype], "w": _DT[wdtype or dtype]}.get(t, t)
        else:
            sig[name] = _INTS.get(name, "i32")
    # what the JIT would specialise on: 16-byte aligned pointers (library-allocated or checked
    # by the launch signature) and ints divisible by 16 outside do_not_specialize. Without
    # these hints nothing vectorises and no loop is pipelined (cp.async needs >= 4 bytes).
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if sig[name].startswith("*") or (name in ints and ints[name] % 16 == 0 and name not in fn.do_not_specialize):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs={k: v for k, v in cx.items()}, attrs=attrs)
    ck = triton_compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, **opts))
    return dict(kernel=fn.__name__, num_warps=warps, **_ptxas(ck, arch, ptx), shared=ck.metadata.shared, **opts,
                mma_versions=_mma_versions(ck), async_copies=ck.asm["ttgir"].count("async_copy_global_to_local"), **{k: v for k, v in cx.items() if k.startswith("BLOCK") or k in ("NUM_STAGES", "STAGES")})


def _ptxas(ck, arch: int, ptx: str | None) -> dict:
    # the bundled ptxas -v on a compiled kernel's PTX: its registers and spill stores
    with tempfile.TemporaryDirectory() as d:
        p = ptx or os.path.join(d, "k.ptx")
        with open(p, "w") as f:
            f.write(ck.asm["ptx"])
        r = subprocess.run([get_ptxas(arch).path, "-v", f"-arch=sm_{arch}a", p, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return dict(regs=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None)


def _mma_versions(ck) -> str:
    return ",".join(sorted(set(re.findall(r"versionMajor = (\d)", ck.asm["ttgir"])))) or "-"


def dz_plan(bias: bool):
    """cublas_vocab_chunks' dz kernel as the library launches it: dz_split_kernel with a bias, else
    dz_band_kernel, at its tile and DZ_STAGES (--set STAGES=N for another depth)."""
    from erase_triton.kernels import vocab_ce_cublas_vocab_chunks as vc
    kernel, (r, c, warps) = vc.dz_kernel(bias)
    return kplan._Plan(kernel, "cublas_vocab_chunks", dict(HAS_BIAS=bias, BLOCK_R=r, BLOCK_C=c, STAGES=vc.DZ_STAGES),
                       warps)


def lse_gemm_report(D: int, arch: int = 90, ptx: str | None = None, bias: bool = True) -> dict:
    """cublas_vocab_chunks' Gluon pass-1 kernel (kernels/vocab_ce_lse_gemm.py) as the library launches it (bf16),
    for a head with a bias or without one."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from erase_triton.kernels import vocab_ce_lse_gemm as lg
    BM, BN, BK = lg.TILE
    desc = lambda rows: (f"tensordesc<bf16[{rows}, {BK}],"  # noqa: E731
                         f"{gl.NVMMASharedLayout.get_default_for([rows, BK], gl.bfloat16)!r}>")
    sig = {"x_desc": desc(BM), "w_desc": desc(BN), "b_ptr": "*bf16", "y_ptr": "*i64", "part_ptr": "*fp32",
           "N": "i32", "C": "i32", "tiles_per": "i32", "HAS_BIAS": "constexpr",
           "KS": "constexpr", "NB": "constexpr", "RESIDENT": "constexpr", "num_warps": "constexpr"}
    cx = dict(HAS_BIAS=bias, KS=-(-D // BK), NB=lg.STAGES, RESIDENT=lg.resident(D), num_warps=lg.WARPS)
    ck = triton_compile(GluonASTSource(fn=lg.lse_gemm_kernel, signature=sig, constexprs=cx),
                        target=GPUTarget("cuda", arch, 32), options=dict(num_warps=lg.WARPS, maxnreg=lg.MAXNREG))
    return dict(kernel="lse_gemm_kernel", num_warps=lg.WARPS, **_ptxas(ck, arch, ptx), shared=ck.metadata.shared,
                threads=ck.metadata.num_warps * 32, maxnreg=lg.MAXNREG,
                mma_versions=_mma_versions(ck), wgmma=ck.asm["ptx"].count("wgmma.mma_async"),
                tma_loads=ck.asm["ptx"].count("cp.async.bulk.tensor"), BLOCK=f"{BM}x{BN}x{BK}", NB=lg.STAGES,
                resident=int(lg.resident(D)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loss", default="ce")
    ap.add_argument("--C", type=int, default=256)
    ap.add_argument("--D", type=int, default=512)
    ap.add_argument("--dtype", default="bf16", choices=list(_DT))
    ap.add_argument("--wdtype", default=None, choices=list(_DT), help="the weight's dtype (default: --dtype)")
    ap.add_argument("--occupancy", type=float, default=None)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--vocab-path", default=None, choices=list(kl.VOCAB_PATHS),
                    help="C > 512: which vocabulary kernel (the cublas paths: their first Triton kernel)")
    ap.add_argument("--set", nargs="*", default=[],
                    help="constexpr overrides, NAME=VALUE (also num_warps, and the compile options maxnreg and num_stages)")
    ap.add_argument("--ptx", default=None, metavar="PATH", help="also write the kernel's PTX to PATH")
    ap.add_argument("--lse-gemm", action="store_true",
                    help="report cublas_vocab_chunks' Gluon lse kernel (bf16, --D) instead")
    ap.add_argument("--dz", action="store_true",
                    help="report cublas_vocab_chunks' dz kernel (--dtype; --C classes a chunk) instead")
    ap.add_argument("--no-bias", action="store_true",
                    help="with --lse-gemm or --dz: the kernel of a head without a bias")
    args = ap.parse_args()
    if args.lse_gemm:
        r = lse_gemm_report(args.D, ptx=args.ptx, bias=not args.no_bias)
        print(" ".join(f"{k}={v}" for k, v in r.items()))
        return 0
    if args.dz:
        plan = dz_plan(not args.no_bias)
    else:
        plan = plan_constexprs(args.loss, args.C, args.D, args.dtype, args.occupancy, args.deterministic,
                               args.vocab_path)
    over = dict(kv.split("=", 1) for kv in args.set)
    ints = dict(D=args.D, C=args.C, stride_h=args.D, stride_z=args.C, stride_g=-(-(args.C * args.D + args.C + 1) // 16) * 16, chunk=2048)
    if args.dz:  # (a chunk of --C classes: its width, as the JIT specializes it)
        ints["n"] = args.C
    r = report(plan, args.dtype, over, ints, wdtype=args.wdtype, ptx=args.ptx)
    print(" ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
