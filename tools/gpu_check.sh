#!/usr/bin/env bash
# One-shot GPU check of megadlms (`make gpu-check`), made to run offline on a GPU box as
# it is (its own python with torch, no package index) inside one total time budget
# (default 8 minutes). Steps, most valuable first; each gets what is left of the budget
# (up to its own cap) and is not started, but reported as "not reached", when too little
# is left (the caps up to pytest-gpu fit the default budget; --dry-run writes the plan):
#   1. environment: GPU, driver, nvcc, torch / CUDA / NCCL versions, tools found;
#   2. build: the extension with CUDA, all cores, SASS for the GPUs present only
#      (pip install --no-deps --no-build-isolation --no-index -e .: nothing is fetched);
#   3. trainer: the real trainer (benchmarks/bench_trainer.py: the ~1B DLM, bf16, mock data,
#      one GPU, seq 2048 and 4096, DDP and FSDP2, with and without selective recompute):
#      s/iter, tokens/s, TFLOP/s/GPU, MFU of the bf16 matmul ceiling measured in the run and
#      of the datasheet, memory, the SDPA backend, each run's exit status; its rows share the
#      step's limit, a row without time left is "not reached";
#   4. pytest-gpu: `pytest -m gpu` over the test files that hold GPU tests (a child process
#      that used every CUDA object must exit 0: tests/training/test_cuda_exit.py);
#   5. optimizer: AdamW on 1.41B params, torch foreach / fused and ours against the memory
#      floor (benchmarks/bench_optimizer.py);
#   6. bench-gpu: the figures table (benchmarks/bench_gpu.py: the extension's ops, eager and
#      kernel-only by graph replay, the ~1B DLM step's MFU against the measured ceiling);
#   7. wrappers: FSDP2 against DDP on one GPU, where the difference goes
#      (benchmarks/bench_wrappers.py, a profile by kernel family);
#   8. memcheck: compute-sanitizer memcheck of the extension's kernel tests with
#      PYTORCH_NO_CUDA_MEMORY_CACHING=1 (no profiler or CUDA-graph test: CUPTI conflicts
#      with the sanitizer, and the uncached allocator cannot allocate under capture; API
#      errors not reported: a non-success return is an answer, not a memory error);
#      no compute-sanitizer on PATH is a SKIP.
# With 2+ GPUs bench-gpu-multi adds the DDP step and a collective sweep under torchrun.
# The summary has one PASS / FAIL / SKIP line per step; the exit status is non-zero if a
# step failed. What comes back from a lent GPU machine is at most 8 files, so under $OUT
# there are three: summary.txt, figures.md (every benchmark table) and logs.tar.gz (each
# step's log, re-archived after every step so a run cut short still returns what it did).
# Without $OUT the logs stay as files in $LOG_DIR (default build/gpu-check).
#
#   tools/gpu_check.sh                 # needs a CUDA GPU
#   tools/gpu_check.sh --budget 6      # total budget in minutes (default 8)
#   tools/gpu_check.sh --dry-run       # no GPU: checks the script, the offline install
#                                      # plan and the benchmarks on CPU (no build)
# Environment: PY (python; default: the first of .venv/bin/python, python3 that imports
# torch), GPU_CHECK_JOBS (build jobs, default nproc), MEGADLM_CUDA_ARCHS (default: the
# visible GPUs' compute capabilities), SKIP_BUILD=1 (reuse the extension already built).
set -u -o pipefail

DRY=0
BUDGET_MIN=8
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --budget)
      [[ $# -ge 2 && "$2" =~ ^[0-9]+([.][0-9]+)?$ ]] || {
        echo "gpu_check.sh: --budget needs minutes, e.g. --budget 8" >&2
        exit 2
      }
      BUDGET_MIN="$2"
      shift
      ;;
    -h | --help)
      sed -n '2,41p' "$0"
      exit 0
      ;;
    *)
      echo "gpu_check.sh: unknown argument '$1' (use --dry-run, --budget MIN or --help)" >&2
      exit 2
      ;;
  esac
  shift
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
# The CUDA devices python $1 sees; prints nothing when it cannot import torch. One torch
# import both checks the python and counts the GPUs (each import costs seconds).
cuda_devices() {
  "$1" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null | tail -1
}
DEVICES=""
if [[ -z "${PY:-}" ]]; then
  for cand in "$ROOT/.venv/bin/python" "$(command -v python3 || true)"; do
    if [[ -n "$cand" && -x "$cand" ]]; then
      DEVICES="$(cuda_devices "$cand")"
      if [[ -n "$DEVICES" ]]; then
        PY="$cand"
        break
      fi
    fi
  done
else
  DEVICES="$(cuda_devices "$PY")"
fi
if [[ -z "${PY:-}" || ! "$DEVICES" =~ ^[0-9]+$ ]]; then
  echo "gpu_check.sh: no python with torch found (set PY=/path/to/python)" >&2
  exit 2
fi
# The results folder ($OUT, else $LOG_DIR): summary.txt, figures.md and, under $OUT, the logs
# as one archive; the logs themselves are written to WORK.
RESULTS="${OUT:-${LOG_DIR:-$ROOT/build/gpu-check}}"
if [[ -n "${OUT:-}" ]]; then
  # A folder of this run's own (two runs at once must not share one), removed at exit.
  WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-logs.XXXXXX")"
  trap 'rm -rf "$WORK"' EXIT
else
  WORK="$RESULTS"
fi
mkdir -p "$RESULTS" "$WORK"
FIGURES="$RESULTS/figures.md"
rm -f "$FIGURES" "$RESULTS/summary.txt" "$RESULTS/logs.tar.gz"
export PYTHONPATH="$ROOT/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BUDGET_S=$(awk -v m="$BUDGET_MIN" 'BEGIN { printf "%d", m * 60 }')
JOBS="${GPU_CHECK_JOBS:-$(nproc)}"  # the Makefile's MAX_JOBS=2 (shared CPU box) is not used here
START=$SECONDS
SUMMARY=()
FAILED=0

left() { echo $((BUDGET_S - (SECONDS - START))); }

# The summary and (under $OUT) the log archive, rewritten after every step.
write_results() {
  {
    echo "gpu_check summary: $((SECONDS - START))s of a ${BUDGET_S}s budget, dry-run=$DRY, results in $RESULTS"
    printf '%s\n' "${SUMMARY[@]}"
  } >"$RESULTS/summary.txt"
  if [[ "$WORK" != "$RESULTS" ]]; then tar -czf "$RESULTS/logs.tar.gz" -C "$WORK" . 2>/dev/null; fi
  return 0
}

record() {
  SUMMARY+=("$1")
  echo "$1"
  write_results
}

# step NAME CAP MIN CMD...: run CMD with a limit of min(CAP, budget left - 5 s), logged
# to $WORK/NAME.log and echoed; not started when less than MIN s are left (a SKIP that says
# "not reached": the budget, not the step, ended it).
step() {
  local name="$1" cap="$2" min="$3"
  shift 3
  local avail limit log="$WORK/$name.log" t0=$SECONDS rc
  avail=$(($(left) - 5))
  if [[ $avail -lt $min ]]; then
    record "SKIP  $name: not reached, budget spent (${avail}s left, needs ${min}s; raise --budget)"
    return 0
  fi
  limit=$((cap < avail ? cap : avail))
  echo
  echo "=== [$name] $* (limit ${limit}s, budget left $(left)s)"
  # STEP_LIMIT: a command that bounds its own parts (the trainer's rows) fits them into it
  STEP_LIMIT=$limit timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0))
  if [[ $rc -eq 0 ]]; then
    record "PASS  $name (${took}s)"
  elif [[ ($rc -eq 124 || $rc -eq 137) && $limit -lt $cap ]]; then
    # cut by what was left of the budget, not by its own cap: unfinished, not failed
    record "SKIP  $name: not finished, the budget ended it after ${took}s (raise --budget) -- see $name.log"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    record "FAIL  $name: stopped at its ${limit}s limit (hang?) -- see $name.log"
    FAILED=1
  else
    record "FAIL  $name: exit $rc (${took}s) -- see $name.log"
    FAILED=1
  fi
  return 0
}

skip() {
  echo
  record "SKIP  $1: $2"
}

environment() {
  echo "host: $(hostname)  date: $(date -u +%FT%TZ)  dry-run: $DRY  budget: ${BUDGET_S}s  jobs: $JOBS"
  echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  if command -v nvcc >/dev/null 2>&1; then nvcc --version | tail -2; else echo "nvcc: not found"; fi
  for tool in compute-sanitizer ncu torchrun; do
    printf '%s: %s\n' "$tool" "$(command -v "$tool" || echo 'not found')"
  done
  "$PY" - <<'EOF'
import importlib.util
import torch

print("torch", torch.__version__, "| torch CUDA", torch.version.cuda,
      "| devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)
try:
    print("torch NCCL", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as exc:  # CPU torch: no NCCL
    print("torch NCCL: n/a (%s)" % type(exc).__name__)
for mod in ("pytest", "pytest_timeout", "hypothesis", "numpy", "transformers", "setuptools", "ninja"):
    print(f"{mod}: {'found' if importlib.util.find_spec(mod) else 'MISSING (tests needing it skip or fail)'}")
try:
    import megadlm_ext
    print("megadlm_ext", megadlm_ext.backend_info())
except Exception as exc:
    print("megadlm_ext: not importable (%s)" % exc)
EOF
}

self_check() {
  bash -n "$SCRIPT" || return 1
  if command -v shellcheck >/dev/null 2>&1; then
    shellcheck "$SCRIPT" || return 1
  else
    echo "shellcheck not installed: bash -n only"
  fi
  echo "script syntax OK"
}

# `timeout` runs programs, not shell functions: export them for `bash -c`.
SCRIPT="$ROOT/tools/gpu_check.sh"
export -f environment self_check
export DRY PY SCRIPT BUDGET_S JOBS

# The install of the project itself, offline: no dependencies, no build isolation, no index.
INSTALL=("$PY" -m pip install --no-deps --no-build-isolation --no-index -e .)
# Test files holding GPU tests: `pytest -m gpu` over them only, so an optional package a
# CPU-only test module imports (missing on the box) cannot stop the collection.
mapfile -t GPU_TESTS < <(grep -rlE "mark\.gpu|pytestmark = .*gpu" tests --include='test_*.py' | sort)
TIMEOUT_ARGS=()
if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then TIMEOUT_ARGS=(--timeout=60); fi

NGPU=0
if [[ $DRY -eq 0 ]]; then
  NGPU=$DEVICES
  if [[ "$NGPU" -lt 1 ]]; then
    echo "gpu_check.sh: no CUDA device visible to $PY; run with --dry-run on a machine without a GPU" >&2
    exit 2
  fi
fi

# The kernel tests memcheck runs (compiled ops; no multi-process NCCL test).
MEMCHECK_TESTS=(tests/ext/test_cuda.py tests/ext/test_cuda_gpu_path.py tests/ext/test_grouped_gemm.py
  tests/ext/test_wgrad.py tests/ext/test_fused_gpu.py tests/ext/test_adamw.py tests/ext/test_table_gpu.py)

# The GPU steps, most valuable first: NAME CAP MIN, then the command. The caps of the steps up
# to pytest-gpu add up to less than the default budget (the budget never cuts them; only a
# hang does); what follows gets what is left, and a step the budget does not reach is a
# "not reached" SKIP. Measured on the first run (H200): build 44 s, pytest -m gpu 25 s, a
# trainer row ~20-25 s.
ARCHS="${MEGADLM_CUDA_ARCHS:-}"
if [[ $DRY -eq 0 && -z "$ARCHS" ]]; then
  ARCHS="$("$PY" -c "import torch; print(';'.join(sorted({'%d%d' % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))")"
fi
STEP_BUILD=(build 120 60 env MEGADLM_EXT_CUDA=1 MAX_JOBS="$JOBS" MEGADLM_CUDA_ARCHS="$ARCHS" CFLAGS=-g0 "${INSTALL[@]}")
STEP_CUDA_CHECK=(cuda-build-check 20 10 "$PY" -c "import megadlm_ext as e, megadlm_ext.nccl as n; \
i = e.backend_info(); assert i['cuda'] and i['nccl'], i; print(i, 'libnccl', n.version())")
# The real trainer (~1B DLM, seq 2048 / 4096, DDP / FSDP2, +- selective recompute): its rows
# share the step's limit (--deadline); a row without time left is "not reached" in its table.
trainer_rows() {
  echo "$PY benchmarks/bench_trainer.py --iters 6 --deadline $((STEP_LIMIT - 10)) --out $FIGURES"
  "$PY" benchmarks/bench_trainer.py --iters 6 --deadline $((STEP_LIMIT - 10)) --out "$FIGURES"
}
STEP_TRAINER=(trainer 190 90 bash -c trainer_rows)
STEP_PYTEST=(pytest-gpu 90 45 "$PY" -m pytest -q -m gpu "${GPU_TESTS[@]}" -p no:cacheprovider -rfEs "${TIMEOUT_ARGS[@]}")
STEP_OPTIMIZER=(optimizer 60 30 "$PY" benchmarks/bench_optimizer.py --out "$FIGURES")
STEP_BENCH=(bench-gpu 120 60 "$PY" benchmarks/bench_gpu.py --out "$FIGURES")
STEP_BENCH_MULTI=(bench-gpu-multi 120 45 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU"
  benchmarks/bench_gpu.py --sections ddp,comm --out "$FIGURES")
STEP_WRAPPERS=(wrappers 90 60 "$PY" benchmarks/bench_wrappers.py --micro 2 --reps 2 --out "$FIGURES")
# No caching allocator: every tensor its own allocation, so an out-of-bounds access is not
# hidden inside a larger cached segment. That allocator refuses allocation under CUDA-graph
# capture, so the capture tests (marked cuda_graph) stay out, as do the profiler tests (CUPTI
# conflicts with the sanitizer). --report-api-errors no: a CUDA API call's non-success return
# (a cudaStreamQuery answering "not ready", torch probing a feature) is an answer, not a memory
# error, and with --error-exitcode it would fail the step; memory errors still count.
STEP_MEMCHECK=(memcheck 120 45 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck
  --error-exitcode 1 --report-api-errors no --target-processes all "$PY" -m pytest -q
  -m "gpu and not slow and not profiler and not cuda_graph" "${MEMCHECK_TESTS[@]}" -p no:cacheprovider)
GPU_STEPS=(STEP_BUILD STEP_CUDA_CHECK STEP_TRAINER STEP_PYTEST STEP_OPTIMIZER STEP_BENCH STEP_BENCH_MULTI
  STEP_WRAPPERS STEP_MEMCHECK)
export -f trainer_rows
export FIGURES

# The plan of a GPU run: each step's cap, minimum and command, and what the caps add up to.
plan() {
  local total=$((ENV_CAP + SELF_CAP)) must=0 s
  for s in "${GPU_STEPS[@]}"; do
    local -n st="$s"
    printf '%-16s cap %4ss  min %3ss  %s\n' "${st[0]}" "${st[1]}" "${st[2]}" "${st[*]:3}"
    total=$((total + st[1]))
    [[ "${st[0]}" == pytest-gpu ]] && must=$total
  done
  echo "caps through pytest-gpu: ${must}s of the ${BUDGET_S}s budget; all caps: ${total}s" \
    "(the budget cuts the steps after pytest-gpu: a SKIP that says not reached, never a FAIL)"
}

ENV_CAP=20
SELF_CAP=10
step environment "$ENV_CAP" 10 bash -c environment
step self-check "$SELF_CAP" 5 bash -c self_check

if [[ $DRY -eq 1 ]]; then
  plan | tee "$WORK/plan.log"
  # What the real run would install, resolved offline (builds nothing, installs nothing).
  step install-plan 120 20 "${INSTALL[@]}" --dry-run
  # The real run's trainer, wrapper and figures benchmarks, on a tiny model on the CPU (gloo).
  step trainer-dry-run 120 20 "$PY" benchmarks/bench_trainer.py --tiny --rows ddp-s2048,fsdp2-s4096-recompute \
    --iters 2 --out "$FIGURES"
  step bench-gpu-dry-run 180 20 "$PY" benchmarks/bench_gpu.py --dry-run --device cpu --reps 2 --out "$FIGURES"
  step wrappers-dry-run 120 20 "$PY" benchmarks/bench_wrappers.py --device cpu --tiny --reps 1 --micro 2 \
    --wrappers ddp+distopt,fsdp2 --out "$FIGURES"
  for s in build cuda-build-check trainer pytest-gpu optimizer bench-gpu wrappers memcheck; do
    skip "$s" "dry run (needs a GPU)"
  done
  command -v compute-sanitizer >/dev/null 2>&1 || echo "note: compute-sanitizer not on PATH here: memcheck would SKIP"
else
  if [[ "${SKIP_BUILD:-0}" == 1 ]]; then skip build "SKIP_BUILD=1"; else step "${STEP_BUILD[@]}"; fi
  step "${STEP_CUDA_CHECK[@]}"
  step "${STEP_TRAINER[@]}"
  step "${STEP_PYTEST[@]}"
  step "${STEP_OPTIMIZER[@]}"
  step "${STEP_BENCH[@]}"
  if [[ "$NGPU" -ge 2 ]]; then
    step "${STEP_BENCH_MULTI[@]}"
  else
    skip bench-gpu-multi "1 GPU: the collective sweep and DDP comparison need 2+ GPUs"
  fi
  step "${STEP_WRAPPERS[@]}"
  if command -v compute-sanitizer >/dev/null 2>&1; then
    step "${STEP_MEMCHECK[@]}"
  else
    skip memcheck "compute-sanitizer not on PATH (it comes with the CUDA toolkit)"
  fi
fi

write_results
echo
echo "=== $(cat "$RESULTS/summary.txt")"
exit $FAILED
