#!/usr/bin/env bash
# `make glue-check`: syntax-check the translation units only a CUDA build compiles (the
# torch-facing glue and the bindings with MEGADLM_WITH_CUDA) on a machine without a GPU:
# g++ -std=c++17 (torch 2.11's standard) -fsyntax-only -Wall -Wextra -Werror against the
# installed torch's headers and the CUDA toolkit's headers. ATen/cuda/CUDAContext.h also
# pulls in cuBLAS, cuSPARSE and cuSOLVER: their real headers are used where this machine has
# them (the toolkit's include folder, the nvcc on PATH's, or the nvidia-* wheels torch
# installs); otherwise tools/cuda_stubs/mathlibs declares the few types torch names, and the
# output says so. tools/cuda_stubs itself supplies torch's generated cuda_cmake_macros.h,
# which a CPU wheel lacks.
#   PY=python MAX_JOBS=2 CUDA_INCLUDE=/usr/local/cuda/include tools/glue_check.sh [TU...]
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PY:-python3}"
JOBS="${MAX_JOBS:-2}"
MATHLIBS=(cublas_v2.h cublasLt.h cusparse.h cusolverDn.h)

# Candidate include folders, in order: $CUDA_INCLUDE, the nvcc on PATH's toolkit, CUDA_HOME,
# /usr/local/cuda, then the nvidia-* wheels' include folders in torch's site-packages.
candidates() {
  [[ -n "${CUDA_INCLUDE:-}" ]] && echo "$CUDA_INCLUDE"
  local nvcc
  if nvcc="$(command -v nvcc)"; then
    # a wrapper script (exec /usr/local/cuda-X/bin/nvcc) or a link: ask nvcc for its own root
    nvcc -v -x cu -E /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | sed 's|$|/include|'
    echo "$(dirname "$(readlink -f "$nvcc")")/../include"
  fi
  echo "${CUDA_HOME:-/usr/local/cuda}/include"
  echo /usr/local/cuda/include
  "$PY" -c "import glob, os, torch; s = os.path.dirname(os.path.dirname(torch.__file__)); \
print('\n'.join(sorted(glob.glob(s + '/nvidia/*/include') + glob.glob(s + '/nvidia/*/*/include'))))" 2>/dev/null
}

# The first candidate with cuda_runtime.h, and the folders that hold each math library header.
CUDA_INC=""
declare -A FOUND=()
while read -r dir; do
  [[ -d "$dir" ]] || continue
  dir="$(cd "$dir" && pwd)"
  [[ -z "$CUDA_INC" && -f "$dir/cuda_runtime.h" ]] && CUDA_INC="$dir"
  for h in "${MATHLIBS[@]}"; do
    [[ -z "${FOUND[$h]:-}" && -f "$dir/$h" ]] && FOUND[$h]="$dir"
  done
done < <(candidates)
if [[ -z "$CUDA_INC" ]]; then
  echo "glue-check: no CUDA toolkit headers (cuda_runtime.h) found; set CUDA_INCLUDE=/path/to/cuda/include" >&2
  exit 2
fi
MATH=()
if [[ ${#FOUND[@]} -eq ${#MATHLIBS[@]} ]]; then
  mapfile -t dirs < <(printf '%s\n' "${FOUND[@]}" | sort -u)
  for d in "${dirs[@]}"; do MATH+=(-isystem "$d"); done
  echo "glue-check: cuBLAS / cuSPARSE / cuSOLVER: the real headers (${dirs[*]})"
else
  missing=()
  for h in "${MATHLIBS[@]}"; do [[ -n "${FOUND[$h]:-}" ]] || missing+=("$h"); done
  MATH=(-isystem tools/cuda_stubs/mathlibs)
  echo "glue-check: ${missing[*]} not on this machine (searched: $(candidates | tr '\n' ' ')):" \
    "tools/cuda_stubs/mathlibs declares what torch names (declarations only)"
fi
echo "glue-check: CUDA runtime headers: $CUDA_INC; g++ -std=c++17"

mapfile -t TORCH_INC < <("$PY" -c "import os, sysconfig, torch; t = os.path.dirname(torch.__file__); \
print('\n'.join((t + '/include', t + '/include/torch/csrc/api/include', sysconfig.get_paths()['include'])))")
INC=(-I csrc/include -I csrc)
for d in "${TORCH_INC[@]}"; do INC+=(-isystem "$d"); done
INC+=(-isystem tools/cuda_stubs "${MATH[@]}" -isystem "$CUDA_INC")

if [[ $# -gt 0 ]]; then
  TUS=("$@")
else
  TUS=(csrc/glue/*.cpp csrc/bindings.cpp csrc/nccl_bindings.cpp csrc/fused_bindings.cpp
    csrc/tensor_table.cpp csrc/adam_bindings.cpp)
fi
export GLUE_FLAGS="-std=c++17 -fsyntax-only -Wall -Wextra -Werror -DMEGADLM_WITH_CUDA -DTORCH_EXTENSION_NAME=_C ${INC[*]}"
printf '%s\n' "${TUS[@]}" | xargs -P "$JOBS" -I{} sh -c 'echo "glue-check {}" && g++ $GLUE_FLAGS {}'
