"""The user-facing benchmark runner behind `erase-triton bench | sweep | trace | plot`:
workloads, step timing, bounding heads, studies, traces and plots.

Arrows: this package imports the library (models, scheduler, train); nothing in the library
imports it. Scripts under benchmarks/ use only the names exported here and the library's API.
"""
from .heads import HEADS, CompiledTorchHead, FreeHead, free_heads, set_vocab_path, swap_heads, with_heads
from .interpreter import round_bf16_like_the_gpu
from .io import metadata, parse_head_every, print_table, read_csv, write_csv
from .plots import plot_file
from ..progress import progress, say
from .studies import OCCUPANCIES, bench, compile_rows, sweep
from .timing import (copy_bandwidth_gbs, host_us, median_ms, peak_mb, step_runner, tf32_metadata, time_compiled_e2e, time_eager_modes,
                     time_step)
from .trace import trace
from .workloads import (BENCH_CTR, BENCH_TF, COMPILE_AT, CTR_EMBEDDING, bench_cases, ctr_workload, e2e_loss_fn,
                        mlp_workload, transformer_workload)

__all__ = ["BENCH_CTR", "BENCH_TF", "COMPILE_AT", "CTR_EMBEDDING", "CompiledTorchHead", "FreeHead", "HEADS",
           "OCCUPANCIES", "bench", "copy_bandwidth_gbs", "host_us", "parse_head_every", "print_table", "bench_cases", "compile_rows", "ctr_workload", "e2e_loss_fn", "free_heads",
           "median_ms", "metadata", "mlp_workload", "peak_mb", "plot_file", "progress", "read_csv", "round_bf16_like_the_gpu", "say",
           "set_vocab_path", "step_runner", "swap_heads", "sweep", "tf32_metadata", "time_compiled_e2e", "time_eager_modes",
           "time_step", "trace", "transformer_workload", "with_heads", "write_csv"]
