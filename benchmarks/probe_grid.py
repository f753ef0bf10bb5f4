"""Grid size, registers and programs per SM of the MLP proxy's heads (N=4096 D=512, C=1 BCE)
for a few LaunchConfig(occupancy, programs_per_sm) settings: what --beside in
bench_schedule.py launches.   python benchmarks/probe_grid.py"""
import torch

from erase_triton import LaunchConfig, fused_local_head
from erase_triton.kernels import launch, local_head as klh

for dtype in (torch.float32, torch.bfloat16):
    h = torch.randn(4096, 512, device="cuda", dtype=dtype)
    w = torch.randn(1, 512, device="cuda", dtype=dtype) / 23
    b = torch.zeros(1, device="cuda", dtype=dtype)
    y = torch.rand(4096, device="cuda").round()
    for occ, pps in ((0.125, None), (0.25, 2), (0.5, 1), (0.5, 2), (1.0, 1), (None, None)):
        klh._PLANS.clear()
        fused_local_head(h, w, b, y, config=LaunchConfig(occupancy=occ, programs_per_sm=pps))
        plan, = klh._PLANS.values()
        per_sm = [v for k, v in launch._PER_SM.items() if k[1] == id(plan)]
        print(f"{str(dtype)[6:]:8s} occ={occ} pps={pps}: programs {plan.p_occ}, per SM allowed {per_sm}, "
              f"warps {plan.num_warps}, BLOCK_N {plan.constexprs['BLOCK_N']}")
