#!/usr/bin/env bash
# One-shot GPU check of megadlms (`make gpu-check`): on one GPU, in well under 8 minutes,
#   1. prints the environment (GPU, driver, torch / CUDA / NCCL versions),
#   2. builds the extension with CUDA (MEGADLM_EXT_CUDA=1),
#   3. runs `pytest -m gpu` (kernels vs CPU, >2^31-element lists, non-default streams,
#      CUDA-graph capture, the table cache, NCCL at world size 1, two ranks on one GPU
#      ending in a clear error, and with 2+ GPUs the multi-rank NCCL tests),
#   4. runs compute-sanitizer memcheck on the extension's GPU kernel tests,
#   5. prints the GPU benchmark table (ops vs D2D copy and torch foreach with launch
#      counts, DDP step nccl_ext vs torch NCCL, MFU of a ~1B DLM step); with 2+ GPUs the
#      DDP section again under torchrun.
# Every step runs under a time limit and the script goes on after a failure; the
# summary at the end lists each step as PASS / FAIL / SKIP and the exit status is
# non-zero if any step failed.
#
#   tools/gpu_check.sh            # needs a CUDA GPU
#   tools/gpu_check.sh --dry-run  # no GPU: checks this script, runs the CPU-side tests
#                                 # of the GPU path and bench_gpu.py --dry-run on CPU
# Environment: PY (python, default .venv/bin/python or python3), LOG_DIR (default
# build/gpu-check), SKIP_BUILD=1 (reuse the installed build).
set -u -o pipefail

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
if [[ -z "${PY:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi
fi
LOG_DIR="${LOG_DIR:-$ROOT/build/gpu-check}"
mkdir -p "$LOG_DIR"
export PYTHONPATH="$ROOT/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS
SUMMARY=()
FAILED=0

# step NAME LIMIT_SECONDS CMD...: run with a time limit, log to $LOG_DIR/NAME.log, echo
# the output, record the outcome. A timeout (124/137) is reported as a hang.
step() {
  local name="$1" limit="$2"
  shift 2
  local log="$LOG_DIR/$name.log" t0=$SECONDS rc
  echo
  echo "=== [$name] $* (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - t0))
  if [[ $rc -eq 0 ]]; then
    SUMMARY+=("PASS  $name (${took}s)")
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    SUMMARY+=("FAIL  $name: timed out after ${limit}s (hang?) -- see $log")
    FAILED=1
  else
    SUMMARY+=("FAIL  $name: exit $rc (${took}s) -- see $log")
    FAILED=1
  fi
  return 0
}

skip() { SUMMARY+=("SKIP  $1: $2"); echo; echo "=== [$1] skipped: $2"; }

environment() {
  echo "host: $(hostname)  date: $(date -u +%FT%TZ)  dry-run: $DRY"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  if command -v nvcc >/dev/null 2>&1; then nvcc --version | tail -2; else echo "nvcc: not found"; fi
  "$PY" - <<'EOF'
import torch
print("python torch", torch.__version__, "| torch CUDA", torch.version.cuda,
      "| devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)
try:
    print("torch NCCL", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as exc:  # CPU torch: no NCCL
    print("torch NCCL: n/a (%s)" % type(exc).__name__)
try:
    import megadlm_ext
    from megadlm_ext import nccl
    print("megadlm_ext", megadlm_ext.backend_info(), "| libnccl", nccl.version())
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
export DRY PY SCRIPT

NGPU=0
if [[ $DRY -eq 0 ]]; then
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
  if [[ "$NGPU" -lt 1 ]]; then
    echo "gpu_check.sh: no CUDA device visible to $PY; run with --dry-run on a machine without a GPU" >&2
    exit 2
  fi
fi

step environment 60 bash -c environment
step self-check 60 bash -c self_check

if [[ $DRY -eq 1 ]]; then
  step cpu-tests-of-gpu-path 300 "$PY" -m pytest -q tests/ext/test_cuda_emulation.py tests/ext/test_nccl_fake.py \
    -p no:cacheprovider
  step bench-gpu-dry-run 300 "$PY" benchmarks/bench_gpu.py --dry-run --device cpu --reps 2
  for s in build pytest-gpu memcheck bench-gpu multi-gpu; do skip "$s" "dry run (needs a GPU)"; done
else
  if [[ "${SKIP_BUILD:-0}" == 1 ]]; then
    skip build "SKIP_BUILD=1"
  else
    step build 420 env MEGADLM_EXT_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  fi
  step cuda-build-check 60 "$PY" -c "import megadlm_ext as e, megadlm_ext.nccl as n; i = e.backend_info(); \
assert i['cuda'] and i['nccl'], i; print(i, 'libnccl', n.version())"
  step pytest-gpu 420 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider --timeout=300
  if command -v compute-sanitizer >/dev/null 2>&1; then
    step memcheck 420 compute-sanitizer --tool memcheck --error-exitcode 1 --target-processes all \
      "$PY" -m pytest -q -m "gpu and not slow" tests/ext/test_cuda.py tests/ext/test_cuda_gpu_path.py -p no:cacheprovider
  else
    SUMMARY+=("FAIL  memcheck: compute-sanitizer not on PATH (install the CUDA toolkit's sanitizer)")
    FAILED=1
  fi
  step bench-gpu 420 "$PY" benchmarks/bench_gpu.py
  if [[ "$NGPU" -ge 2 ]]; then
    step multi-gpu-ddp 300 "$PY" -m torch.distributed.run --nproc-per-node "$NGPU" benchmarks/bench_gpu.py --sections ddp
  else
    skip multi-gpu "1 GPU: the multi-rank NCCL tests (in pytest-gpu) skipped themselves"
  fi
fi

echo
echo "=== gpu_check summary ($((SECONDS - START)) s, logs in $LOG_DIR)"
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
