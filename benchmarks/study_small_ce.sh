#!/usr/bin/env bash
# The small-vocabulary CE kernel (the transformer's heads) on one GPU, in one call:
#   bash benchmarks/study_small_ce.sh OUT_DIR
# 1. tile / structure sets at the transformer's head shapes (N,D,C = 8192,512,256 and 4096,256,256,
#    bf16), the whole device and 1/8 of it, each checked against the float64 reference
#    (bench_ce_path.py --tiles --sets); PHASES=1 rows time phase A alone;
# 2. the best set at 8192,512,256 and 1/8 (what the w512 transformer's side heads run) in the graphed
#    transformer schedule, against the default, median of 3 captures (with_blocks.py + bench_schedule.py);
# 3. a graphed trace of the MLP w512 b1024 tf32 (ReLU in the heads) with fused, PyTorch and zero-cost heads;
# 4. Nsight Compute source-level stall samples of the default and the best set at 1/8 (if ncu exists).
# SETS overrides the sets of step 1.
set -u
R=${1:?OUT_DIR}; mkdir -p "$R"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
SETS=${SETS:-"PHASES=1;GH_T=1;GH_T=1,PHASES=1;GH_T=1,NUM_STAGES=2;BLOCK_DC=128,NUM_STAGES=2;GH_T=1,BLOCK_DC=128,NUM_STAGES=2;BLOCK_K=128,NUM_STAGES=2;BLOCK_K=128,BLOCK_DC=128,NUM_STAGES=2;GH_T=1,BLOCK_K=128,NUM_STAGES=2;BLOCK_N=128,NUM_STAGES=2;GH_T=1,BLOCK_N=128,NUM_STAGES=2;GH_T=1,BLOCK_N=128,NUM_STAGES=2,PHASES=1"}
echo "=== tiles $(date +%T)"
timeout ${T_TILES:-300} python3 benchmarks/bench_ce_path.py --tiles --sets "$SETS" --shapes "8192,512,256;4096,256,256" \
  --out "$R/ce_small_sets.csv" | grep -v "^{"
BEST=$(python3 - "$R/ce_small_sets.csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["N"] == "8192" and r["occupancy"] == "0.125"
        and r.get("us") and r.get("max_rel_err") and float(r["max_rel_err"]) < 2e-2]
best = min(rows, key=lambda r: float(r["us"]))
print("" if best["tiles"] == "auto" else best["tiles"])
PY
)
echo "best set at 8192,512,256 1/8: '${BEST}'"
echo "=== schedule (default) $(date +%T)"
timeout ${T_SCHED:-200} python3 benchmarks/bench_schedule.py --model transformer --exec graph --captures 3 --free-heads \
  --out "$R/sched_tf_default.csv" | grep -v "^{" | tail -8
if [ -n "$BEST" ]; then
  echo "=== schedule ($BEST) $(date +%T)"
  timeout ${T_SCHED:-200} python3 benchmarks/with_blocks.py _small_ce_blocks "$BEST" -- benchmarks/bench_schedule.py \
    --model transformer --exec graph --captures 3 --free-heads --out "$R/sched_tf_best.csv" | grep -v "^{" | tail -8
fi
echo "=== trace mlp w512 b1024 tf32 $(date +%T)"
timeout ${T_TRACE:-120} python3 -P -m erase_triton.cli trace --out "$R/trace" --only mlp_w512_b1024 --exec graph | tail -4
rm -f "$R"/trace/trace_mlp_*.json  # chrome traces: the kernels_*.json keep the intervals
if command -v ncu >/dev/null; then
  echo "=== ncu $(date +%T)"
  for v in default best; do
    pre=""; [ $v = best ] && { [ -n "$BEST" ] || continue; pre="benchmarks/with_blocks.py _small_ce_blocks $BEST --"; }
    timeout 150 ncu --clock-control none -k regex:_small_ce --launch-skip 4 --launch-count 1 --import-source no \
      --section SpeedOfLight --section WarpStateStats --section SourceCounters -f -o "$R/ncu_$v" \
      python3 $pre benchmarks/ncu_head.py --occupancy 0.125 >/dev/null 2>&1
    ncu -i "$R/ncu_$v.ncu-rep" --page source --csv --print-source sass > "$R/ncu_${v}_sass.csv" 2>&1 || true
    { python3 benchmarks/ncu_ledger.py "$R/ncu_${v}_sass.csv" 45; echo; ncu -i "$R/ncu_$v.ncu-rep" --page details; } \
      > "$R/ncu_${v}.txt" 2>&1 || true
    rm -f "$R/ncu_$v.ncu-rep"
  done
fi
echo "=== done $(date +%T)"
