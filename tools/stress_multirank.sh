#!/usr/bin/env bash
# Repeat a multi-process test N times and count unclean runs (a failed test, a rank that
# died after returning its result -- e.g. SIGABRT "terminate called without an active
# exception" at interpreter exit -- or a run past the per-run time limit).
#
#   tools/stress_multirank.sh [N] [PER_RUN_SECONDS] [pytest target...]
#   tools/stress_multirank.sh 30 240 "tests/distributed/test_ddp.py::test_ddp_matches_torch_ddp[3]"
#
# Exit status 0 only when every run was clean. Logs of unclean runs: $STRESS_LOG_DIR (default
# /tmp/megadlms-stress).
set -u
N=${1:-30}
LIMIT=${2:-240}
shift 2 2>/dev/null || shift $#
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=("tests/distributed/test_ddp.py::test_ddp_matches_torch_ddp[3]")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python}
LOGS=${STRESS_LOG_DIR:-/tmp/megadlms-stress}
mkdir -p "$LOGS"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$ROOT/python:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
bad=0
start=$(date +%s)
for i in $(seq 1 "$N"); do
    log="$LOGS/run_$i.log"
    timeout -k 10 "$LIMIT" "$PY" -m pytest -q -x -p no:cacheprovider "${TARGETS[@]}" >"$log" 2>&1
    rc=$?
    if [ $rc -ne 0 ] || grep -q "terminate called" "$log"; then
        bad=$((bad + 1))
        echo "run $i: UNCLEAN (rc $rc) -> $log"
        grep -m3 -E "terminate called|exited uncleanly|Error" "$log" | sed 's/^/    /'
    else
        rm -f "$log"
        echo "run $i: clean"
    fi
done
echo "stress: $((N - bad))/$N clean runs of ${TARGETS[*]} in $(($(date +%s) - start)) s"
[ $bad -eq 0 ]
