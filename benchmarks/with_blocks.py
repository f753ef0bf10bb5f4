"""Run a benchmark script with some of a fused-head kernel's constexprs replaced.

    python benchmarks/with_blocks.py _small_ce_blocks GH_T=1,BLOCK_DC=128 -- \\
        benchmarks/bench_schedule.py --model transformer --exec graph

The first argument names the host rule in kernels/local_head.py (`_small_ce_blocks`,
`_dense_blocks`, `_vocab_blocks`) whose result is patched for every launch the script
makes (`tune_dense_head.blocks_override`): a candidate tile set measured in a whole
schedule before it becomes the library's default.
"""
from __future__ import annotations

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ce_path import parse_set  # noqa: E402
from tune_dense_head import blocks_override  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    rule, sets, script, rest = argv[0], parse_set(argv[1]), argv[3], argv[4:]
    sys.argv = [script] + rest
    with blocks_override(rule, **sets):
        runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
