#!/usr/bin/env bash
# Every GPU check and benchmark of erase_triton in one command, for one CUDA machine.
#   bash benchmarks/run_gpu_checks.sh [RESULTS_DIR] [parts...]
#   parts: tests ktests host step tune side tiles regs stream twopass head ce schedule sweep trace bench compile early partition   (default: all; together they need more than
#   one 10-minute call on a single H200, so run them in groups)
# Installs the project (no network needed), runs the GPU tests and the studies, and
# leaves CSVs (with GPU name, torch and triton versions), plots and traces in RESULTS_DIR.
# Per-part time limits come from T_<PART> (seconds); extra arguments from SCHED_ARGS, BENCH_ARGS, HEAD_ARGS, TUNE_ARGS, CE_ARGS, SWEEP_ARGS, TRACE_ARGS, COMPILE_ARGS;
# TESTS_K / KTESTS_K select tests (pytest -k) of the tests / ktests parts, CE_OUT, REGS_OUT, STREAM_OUT, TWOPASS_OUT, SCHED_OUT, COMPILE_OUT and EARLY_OUT name the ce, regs, stream, twopass, schedule, compile and early parts' CSVs.
set -u
RES=${1:-benchmarks/results}; shift || true
PARTS=${*:-tests ktests host step tune side tiles regs stream twopass head ce schedule sweep trace bench compile early partition}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then  # optional baselines carried as wheels (liger-kernel)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for p in $PARTS; do
  echo "=== $p $(date +%T)"
  case $p in
    # tests: all of test_gpu.py (56, ~4 min on a cold machine); ktests: the interpreter suite's kernel cases on CUDA
    # (93, ~6 min on a warm machine). Session 13: the two in one part needed more than 420 s.
    tests)    timeout ${T_TESTS:-420} python3 -P -m pytest -q -p no:cacheprovider --timeout 100 -rf tests/test_gpu.py \
                ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -30 ;;
    ktests)   timeout ${T_KTESTS:-540} python3 -P -m pytest -q -p no:cacheprovider --timeout 100 -rf tests/test_local_head.py \
                -k "${KTESTS_K:-gpu or N781 or sum_reduction or deterministic or narrow or atomic or small_ce or relu or act_out or wide_rows or two_pass or out_of_range or mixed}" 2>&1 | tail -30 ;;
    host)     timeout ${T_HOST:-60} python3 benchmarks/profile_host.py 2>&1 | head -40 ;;
    step)     timeout ${T_STEP:-90} python3 benchmarks/profile_step.py 2>&1 | grep -v "^$" | head -70 ;;
    tune)     timeout ${T_TUNE:-240} python3 benchmarks/tune_dense_head.py --out "$RES/tune_dense_head.csv" ${TUNE_ARGS:-} | grep -v "^{" ;;
    side)     timeout ${T_SIDE:-120} python3 benchmarks/tune_side_head.py --out "$RES/side_head.csv" | grep -v "^{" ;;
    tiles)    timeout ${T_TILES:-240} python3 benchmarks/tune_side_head.py --tiles --out "$RES/side_head_tiles.csv" | grep -v "^{" ;;
    regs)     timeout ${T_REGS:-180} python3 benchmarks/tune_side_head.py --regs --out "$RES/${REGS_OUT:-side_head_regs.csv}" | grep -v "^{" ;;
    stream)   timeout ${T_STREAM:-120} python3 benchmarks/tune_side_head.py --stream --out "$RES/${STREAM_OUT:-side_head_stream.csv}" | grep -v "^{" ;;
    twopass)  timeout ${T_TWOPASS:-240} python3 benchmarks/tune_side_head.py --two-pass --out "$RES/${TWOPASS_OUT:-side_head_two_pass.csv}" | grep -v "^{" ;;
    ce)       timeout ${T_CE:-200} python3 benchmarks/bench_ce_path.py --out "$RES/${CE_OUT:-ce_path.csv}" ${CE_ARGS:-} | grep -v "^{" ;;
    head)     timeout ${T_HEAD:-400} python3 benchmarks/bench_local_head.py --out "$RES/local_head.csv" ${HEAD_ARGS:-} ;;
    schedule) timeout ${T_SCHED:-500} python3 benchmarks/bench_schedule.py --out "$RES/${SCHED_OUT:-schedule.csv}" ${SCHED_ARGS:-} | grep -v "^{" ;;
    sweep)    timeout ${T_SWEEP:-300} python3 -P -m erase_triton.cli sweep --out "$RES" ${SWEEP_ARGS:-} | grep -v "^{" ;;
    trace)    timeout ${T_TRACE:-120} python3 -P -m erase_triton.cli trace --out "$RES/trace" ${TRACE_ARGS:-} ;;
    bench)    timeout ${T_BENCH:-400} python3 -P -m erase_triton.cli bench --out "$RES" ${BENCH_ARGS:-} | grep -v "^{" ;;
    # compile: the torch.compile rows (e2e compiled whole; sequential / erase with compiled blocks) and, paired, the
    # uncompiled graphed rows of the same sizes
    compile)  timeout ${T_COMPILE:-480} python3 benchmarks/bench_compile.py --paired --out "$RES/${COMPILE_OUT:-bench_compile.csv}" \
                ${COMPILE_ARGS:-} | grep -v "^{" ;;
    # early: early updates (Scheduler(optimizer=)) vs the update at the end, SGD / foreach Adam / fused Adam (~1.5 min)
    early)    timeout ${T_EARLY:-300} python3 benchmarks/bench_early_update.py --out "$RES/${EARLY_OUT:-early_update.csv}" | grep -v "^{" ;;
    partition) timeout ${T_PART:-240} python3 benchmarks/bench_partition.py --out "$RES/partition.csv" | grep -v "^{" ;;
  esac
done
echo "=== done $(date +%T)"
