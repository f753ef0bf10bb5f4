#!/usr/bin/env bash
# Every GPU check and study of erase_triton, for one CUDA machine.
#   bash benchmarks/run_gpu_checks.sh RESULTS_DIR [parts...]
#   parts: tests ktests sanitizer soak dp head vocab rounds accuracy schedule sweep trace bench compile early quality
#   (default: tests ktests sanitizer soak dp; the studies are listed in benchmarks/README.md)
# Installs the project (no network needed) and leaves logs and CSVs (GPU name, versions, commit,
# command in each .meta.json) in RESULTS_DIR. Per-part time limits: T_<PART> (seconds). Extra
# arguments: SCHED_ARGS, BENCH_ARGS, HEAD_ARGS, VOCAB_ARGS, ROUNDS_ARGS, SWEEP_ARGS, TRACE_ARGS, COMPILE_ARGS; TESTS_K and
# KTESTS_K select tests (pytest -k); KTESTS_FROM=N resumes ktests after its first N selected cases
# (benchmarks/pytest_skip_first.py: the whole selection takes longer than one 10-minute device call).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -u
RES=${1:-runs/gpu}; shift || true
PARTS=${*:-tests ktests sanitizer soak dp}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then  # optional baselines carried as wheels (liger-kernel)
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for p in $PARTS; do
  echo "=== $p $(date +%T)"
  case $p in
    # tests: tests/test_gpu.py; ktests: the interpreter suite's kernel cases, compiled for the GPU
    tests)     timeout ${T_TESTS:-540} python3 -P -m pytest -q -p no:cacheprovider -rf tests/test_gpu.py \
                 ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$RES/gpu_tests.txt" | tail -30 ;;
    ktests)    PYTHONPATH=benchmarks${PYTHONPATH:+:$PYTHONPATH} timeout ${T_KTESTS:-540} python3 -P -m pytest -q \
                 -p no:cacheprovider -p pytest_skip_first -rf tests/test_local_head.py \
                 tests/test_dense_head.py tests/test_small_ce.py tests/test_vocab_ce.py tests/test_properties.py \
                 -k "${KTESTS_K:-(gpu or N781 or sum_reduction or deterministic or narrow or atomic or small_ce or relu or act_out or wide_rows or two_pass or out_of_range or mixed or vocab or properties or matches_float64) and not planted and not stopped}" \
                 2>&1 | tee "$RES/gpu_kernel_tests${KTESTS_FROM:+_from$KTESTS_FROM}.txt" | tail -30 ;;
    # sanitizer: memcheck, racecheck and synccheck over erase steps and every head kernel
    sanitizer) for tool in memcheck racecheck synccheck; do for what in steps heads; do
                 # cuDNN's flash-attention backward is what synccheck flags in the steps (docs/results.md)
                 timeout ${T_SANITIZER:-300} compute-sanitizer --tool $tool --print-limit 1000 --error-exitcode 9 \
                   python3 benchmarks/check_reliability.py $what $([ $what = steps ] && echo --no-cudnn-sdpa) \
                   > "$RES/sanitizer_${tool}_${what}.txt" 2>&1
                 echo "$tool $what: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$RES/sanitizer_${tool}_${what}.txt") clean summaries)"
                 # the kernels the reports name, counted (racecheck's on the cublas path: cuBLAS split-K GEMMs)
                 grep -oE "(access|at) [A-Za-z_][A-Za-z0-9_]+\+0x" "$RES/sanitizer_${tool}_${what}.txt" | sort | uniq -c | head
               done; done
               # racecheck's reports in the Gluon pass (lse_gemm_kernel) reproduced without its code: a warp-specialized
               # kernel with and without a barrier of its default partition's warps (check_reliability.py's docstring)
               for b in "" --barrier; do
                 timeout 120 compute-sanitizer --tool racecheck --print-limit 10 python3 benchmarks/check_reliability.py \
                   ws_switch $b > "$RES/sanitizer_racecheck_ws_switch${b:+_barrier}.txt" 2>&1
                 echo "racecheck ws_switch ${b:-(no barrier)}: exit $?, $(grep -h "RACECHECK SUMMARY" \
                   "$RES/sanitizer_racecheck_ws_switch${b:+_barrier}.txt")"
               done ;;
    soak)      timeout ${T_SOAK:-600} python3 benchmarks/check_reliability.py soak --steps 2000 --out "$RES/soak.csv" ;;
    # dp: data parallel over every GPU here (world 1 on a one-GPU machine) and the 1-GPU reference
    dp)        timeout ${T_DP:-300} torchrun --nproc_per_node 1 benchmarks/bench_data_parallel.py --out "$RES/dp_1.csv" | tail -12
               if [ "$NGPU" -gt 1 ]; then
                 timeout ${T_DP:-300} torchrun --nproc_per_node "$NGPU" benchmarks/bench_data_parallel.py --trace \
                   --out "$RES/dp_$NGPU.csv" | tail -14
                 python3 benchmarks/bench_data_parallel.py --summary "$RES/dp_1.csv" "$RES/dp_$NGPU.csv" --out "$RES/data_parallel.csv"
               fi ;;
    head)      timeout ${T_HEAD:-400} python3 benchmarks/bench_local_head.py --out "$RES/local_head.csv" ${HEAD_ARGS:-} ;;
    vocab)     timeout ${T_VOCAB:-540} python3 benchmarks/bench_local_head.py --vocab --out "$RES/vocab_ce.csv" ${VOCAB_ARGS:-} ;;
    accuracy)  timeout ${T_ACCURACY:-300} python3 benchmarks/bench_vocab_accuracy.py --out "$RES/vocab_accuracy.csv" ;;
    rounds)    timeout ${T_ROUNDS:-240} python3 benchmarks/bench_vocab_rounds.py --out "$RES/vocab_rounds.csv" ${ROUNDS_ARGS:-} ;;
    schedule)  timeout ${T_SCHED:-500} python3 benchmarks/bench_schedule.py --out "$RES/schedule_grid.csv" \
                 ${SCHED_ARGS:---exec graph --captures 3 --free-heads --relu-in-head both} | grep -v "^{" ;;
    sweep)     timeout ${T_SWEEP:-300} python3 -P -m erase_triton.cli sweep --out "$RES" ${SWEEP_ARGS:-} | grep -v "^{" ;;
    trace)     timeout ${T_TRACE:-120} python3 -P -m erase_triton.cli trace --out "$RES/trace" ${TRACE_ARGS:-} ;;
    bench)     timeout ${T_BENCH:-400} python3 -P -m erase_triton.cli bench --out "$RES" ${BENCH_ARGS:-} | grep -v "^{" ;;
    compile)   timeout ${T_COMPILE:-480} python3 benchmarks/bench_compile.py --paired --out "$RES/compile.csv" \
                 ${COMPILE_ARGS:-} | grep -v "^{" ;;
    early)     timeout ${T_EARLY:-300} python3 benchmarks/bench_early_update.py --out "$RES/early_update.csv" | grep -v "^{" ;;
    quality)   timeout ${T_QUALITY:-400} python3 benchmarks/bench_quality.py --seeds 0 --lm-seeds 2 --head-every 1,2,3 \
                 --modes e2e erase --out "$RES/quality_lm.csv" | grep -v "^{" ;;
    *)         echo "unknown part $p" ;;
  esac
done
echo "=== done $(date +%T)"
