#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: environment, optional wheels, the CUDA tests and the
# kernels' test files (compiled kernels, no interpreter; in parallel with pytest-xdist where it is
# installed), the row kernels' meta-parameters timed, the ops' profile and host time, then the
# benchmark, inside a time budget (default 540 s: a run fits in 10 minutes of device time),
# everything to $OUT:
#   check.log     every step's output          summary.txt  step exit codes, the results and
#                                                            targets tables (bench.report)
#   results.json  the benchmark's records       extras.tar   plots, results.md, junit XML
#   tune.json     bench/tune_rows.py's records  profile.txt  bench/profile_ops.py's output
#   chunks.json   bench/linear_chunks.py's records (the lm-head op's chunk size, both ways of
#                 summing its weight gradient)
#   host.json     bench/host_time.py's records (host time a call beside the device's, and Liger's)
#
#   here, where PyPI is reachable (once):  bash bench/gpu_check.sh --fetch-wheels   -> .whl/
#   on the GPU machine (no network):       bash bench/gpu_check.sh        (carry .whl)
#   rehearsal on a CPU-only machine:       OUT=/tmp/gpu_check bash bench/gpu_check.sh --cpu
#
# Knobs (environment): GPU_CHECK_BUDGET_S (total seconds, default 540; 600 with --cpu), SKIP_TESTS=1
# (no test steps: a rerun), SKIP_TUNE=1 / SKIP_CHUNKS=1 (no tuning sweep), BENCH_ARGS (extra
# arguments for python -m bench.run; a later --impls replaces the default subset).
set -uo pipefail
cd "$(dirname "$0")/.."

LIGER_PIN="liger-kernel==0.8.5"
PEER_PINS=("trl==1.16.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19")
PY=${PYTHON:-python3}
MODE=cuda
case "${1:-}" in
  --cpu) MODE=cpu ;;
  --fetch-wheels)
    # The GPU machine reaches no registry: bring the peers the benchmark compares with as wheels
    # (Liger-Kernel; TRL and what TRL imports that a CUDA image usually lacks; all pure Python).
    mkdir -p .whl .git/info
    grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" -d .whl "$LIGER_PIN" "${PEER_PINS[@]}" ;;
  "") ;;
  -h|--help) echo "usage: bash bench/gpu_check.sh [--cpu | --fetch-wheels]"; exit 0 ;;
  *) echo "usage: bash bench/gpu_check.sh [--cpu | --fetch-wheels]" >&2; exit 2 ;;
esac

OUT=${OUT:-/tmp/ftis_gpu_check}; export OUT
mkdir -p "$OUT"
WORK=$(mktemp -d)
LOG="$OUT/check.log"
SUMMARY="$OUT/summary.txt"
: > "$LOG"; : > "$SUMMARY"
DEFAULT_BUDGET=540
[[ "$MODE" == cpu ]] && DEFAULT_BUDGET=600  # 2 cores and the interpreter: the kernel tests take ~4 min
BUDGET=${GPU_CHECK_BUDGET_S:-$DEFAULT_BUDGET}
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME LIMIT_S CMD...: run with a timeout, log everything, record the exit code.
step() {
  local name=$1 limit=$2; shift 2
  local avail; avail=$(left)
  if (( limit > avail - 5 )); then limit=$(( avail - 5 )); fi
  if (( limit < 10 )); then
    echo "$name: skipped (budget spent)" | tee -a "$SUMMARY" "$LOG"; return 0
  fi
  echo "=== $name (limit ${limit}s, $(left)s of ${BUDGET}s left) $(date -u +%H:%M:%S)" >> "$LOG"
  local t0; t0=$(date +%s)
  local steplog="$WORK/$name.log"
  timeout --kill-after=10 "$limit" "$@" > "$steplog" 2>&1
  local rc=$?
  cat "$steplog" >> "$LOG"
  local what="rc=$rc"
  (( rc == 124 || rc == 137 )) && what="rc=$rc (timed out)"
  # pytest's closing line ("3 failed, 40 passed, 2 skipped in 61.2s"), when there is one.
  local counts; counts=$(grep -E '^=*.*[0-9]+ (passed|failed|error|errors|skipped|deselected)' "$steplog" | tail -n 1 | tr -d '=')
  echo "$name: $what in $(( $(date +%s) - t0 ))s${counts:+ --${counts}}" | tee -a "$SUMMARY" >> "$LOG"
  rm -f "$steplog"
  return 0
}

# 1. What the machine is.
step env 30 bash -c "
  uname -a; nproc; free -g | head -2
  $PY -c 'import sys, torch, triton; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(\"triton\", triton.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\")'
  $PY -m pip list 2>/dev/null | grep -iE '^(torch|triton|pytest|pytest-benchmark|hypothesis|matplotlib|liger[-_]kernel|transformers|trl) '
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
  git log -1 --format='commit %H %cd' 2>/dev/null || true"

# 2. The bench-only extra: wheels carried in .whl/, else PyPI where it is reachable, else none.
if ls .whl/*.whl >/dev/null 2>&1; then
  step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ftis_site .whl/*.whl
  export PYTHONPATH="/tmp/ftis_site:$PYTHONPATH"
elif ! "$PY" -c 'import liger_kernel' >/dev/null 2>&1; then
  step pypi-liger 60 "$PY" -m pip install -q --no-deps "$LIGER_PIN"
fi
"$PY" -c 'import liger_kernel' >/dev/null 2>&1 && echo "liger-kernel: importable" >> "$SUMMARY" \
  || echo "liger-kernel: NOT importable (Liger rows will say unavailable)" >> "$SUMMARY"

if [[ "$MODE" == cpu ]]; then
  # The rehearsal: every step's logic, on a small grid (the CPU path, interpreter off in the bench;
  # the tests run the kernels under the interpreter, as tests/conftest.py sets it without CUDA).
  CUDA_LIMIT=90; KERNEL_LIMIT=300; TUNE_LIMIT=60; PROFILE_LIMIT=90
  BENCH_DEFAULT=(--device cpu --max-cases 1 --impls ref_eager,ftis_loss,liger_triton
                 --warmup 1 --min-reps 2 --min-time-s 0)
  TUNE_ARGS=(--device cpu --shapes 16x5000:bf16 --budget-s 30); CHUNKS_LIMIT=60
  CHUNKS_ARGS=(--device cpu --tokens 256 --vocab 2000 --hidden 64 --sizes 128 --reps 1)
  PROFILE_ARGS=(--device cpu --tokens 64 --vocab 1000 --hidden 64 --linear-tokens 64 --reps 2
                --linear-reps 1)
  HOST_ARGS=(--device cpu --rounds 2 --reps 5)
else
  CUDA_LIMIT=80; KERNEL_LIMIT=140; TUNE_LIMIT=80; PROFILE_LIMIT=50
  # The library and its peers on the same work; the references (eager and compiled PyTorch,
  # tens of seconds a case at these sizes) were measured in the baseline beside this file's
  # results, and BENCH_ARGS="--impls ..." brings them back.
  BENCH_DEFAULT=(--device cuda --impls ftis_loss,ftis_loss_3pass,ftis_loss_inplace,ftis_loss_filter,trl_eager,liger_triton,liger_triton_inplace,ftis_linear_loss,ftis_linear_loss_wacc,trl_fused)
  # The gradient-in-forward kernel's configurations only: the forward's and the backward's were
  # timed on the H200 before (bench/results/h200-2026-12-04-glue/tune.json).
  TUNE_ARGS=(--device cuda --budget-s 60 --kernels grad); CHUNKS_LIMIT=75
  CHUNKS_ARGS=(--device cuda --hidden 1536 4096 --sizes 2048 4096)
  PROFILE_ARGS=(--device cuda --reps 10 --linear-reps 4)
  HOST_ARGS=(--device cuda --rounds 3 --reps 20)
fi

# The test files of the kernels and of what runs them on the GPU (compile, sharding): all their
# tests. Elsewhere in tests/ and bench/: the tests marked cuda.
KERNEL_TESTS=(tests/test_ftis_loss.py tests/test_ftis_linear_loss.py tests/test_ftis_logprobs.py
              tests/test_sharded.py tests/test_compile.py tests/kernel_rows/)
# The CPU rehearsal checks the step's mechanics on the quickest of them (the interpreter takes
# about 15 minutes over all of them on 2 cores; CI runs them all).
[[ "$MODE" == cpu ]] && KERNEL_TESTS_RUN=(tests/test_ftis_logprobs.py tests/kernel_rows/) \
  || KERNEL_TESTS_RUN=("${KERNEL_TESTS[@]}")
CUDA_TESTS=()
while read -r file; do
  for kernel_test in "${KERNEL_TESTS[@]}"; do [[ "$file" == "$kernel_test"* ]] && continue 2; done
  CUDA_TESTS+=("$file")
done < <(grep -rlE 'mark\.cuda' tests bench --include='*.py' | sort)
# pytest-xdist where it is installed: one worker per core (pytest-benchmark then only runs its
# tests once, untimed: the benchmark step below times).
# The CUDA tests go to the workers file by file (--dist loadfile): the benchmark's tests allocate
# gigabytes each, and sixteen of them at once ran the GPU out of memory.
PARALLEL=(); PARALLEL_CUDA=()
"$PY" -c 'import xdist' >/dev/null 2>&1 && PARALLEL=(-n auto) && PARALLEL_CUDA=(-n auto --dist loadfile)
echo "pytest in parallel: ${PARALLEL[*]:-no (pytest-xdist not installed)}" >> "$SUMMARY"

if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  # 3. The tests marked cuda outside the kernels' files (exit 5: none selected). On a GPU machine
  #    tests/conftest.py leaves TRITON_INTERPRET unset: the kernels are compiled.
  step pytest-cuda "$CUDA_LIMIT" "$PY" -m pytest "${CUDA_TESTS[@]}" -m cuda -q -rfE \
    -p no:cacheprovider --benchmark-disable ${PARALLEL_CUDA[@]+"${PARALLEL_CUDA[@]}"} \
    --junitxml="$WORK/junit_cuda.xml"
  # 4. The kernels' test files, every test (the hypothesis properties, awkward shapes, sharding,
  #    torch.compile, the CUDA-only comparisons).
  step pytest-kernels "$KERNEL_LIMIT" "$PY" -m pytest "${KERNEL_TESTS_RUN[@]}" -q -rfE \
    -p no:cacheprovider ${PARALLEL[@]+"${PARALLEL[@]}"} --junitxml="$WORK/junit_kernels.xml"
fi

# 5. The row kernels' meta-parameters timed beside a copy of the same logits (bench/tune_rows.py),
#    then where the ops' time goes (bench/profile_ops.py: launches, host reads, top kernels).
[[ "${SKIP_TUNE:-0}" == 1 ]] || step tune "$TUNE_LIMIT" "$PY" -m bench.tune_rows "${TUNE_ARGS[@]}" \
  --out "$OUT/tune.json"
[[ "${SKIP_CHUNKS:-0}" == 1 ]] || step chunks "$CHUNKS_LIMIT" "$PY" -m bench.linear_chunks \
  "${CHUNKS_ARGS[@]}" --out "$OUT/chunks.json"
step profile "$PROFILE_LIMIT" bash -c '"$0" -m bench.profile_ops "${@}" > "$OUT/profile.txt" 2>&1;
  rc=$?; cat "$OUT/profile.txt"; exit $rc' "$PY" "${PROFILE_ARGS[@]}"
# The host's time a call beside the device's, ours and Liger's, at 1k tokens (bench/host_time.py).
step host 90 "$PY" -m bench.host_time "${HOST_ARGS[@]}" --json "$OUT/host.json"

# 6. The benchmark, in what is left (it writes results.json after every record, so a timeout
#    still leaves the measured part). Its linear cases time ftis_linear_loss beside TRL 1.16's
#    fused lm-head (trl_fused) and TRL's materialised selective_log_softmax path (trl_eager), and
#    pytest-cuda above checks their losses against the reference first (bench/test_bench.py).
BENCH_BUDGET=$(( $(left) - 45 ))
# shellcheck disable=SC2086
step bench $(( $(left) - 15 )) "$PY" -m bench.run "${BENCH_DEFAULT[@]}" --out "$WORK/bench" \
  --budget-s "$BENCH_BUDGET" ${BENCH_ARGS:-}

if [[ -f "$WORK/bench/results.json" ]]; then
  cp "$WORK/bench/results.json" "$OUT/results.json"
  [[ -f "$WORK/bench/results.md" ]] || "$PY" -m bench.report "$WORK/bench/results.json" > "$WORK/bench/results.md"
  ls "$WORK"/bench/*.png >/dev/null 2>&1 || "$PY" -m bench.plot "$WORK/bench/results.json" >> "$LOG" 2>&1
fi
tar -C "$WORK" -cf "$OUT/extras.tar" . 2>> "$LOG"
rm -rf "$WORK"

{
  echo "--- gpu_check ($MODE) finished in $(( $(date +%s) - START ))s of ${BUDGET}s"
  [[ -f "$OUT/results.json" ]] && "$PY" -m bench.report "$OUT/results.json"
} >> "$SUMMARY" 2>&1
cat "$SUMMARY"
