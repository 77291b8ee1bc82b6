#!/usr/bin/env bash
# Repeat multi-process tests N times and count unclean runs: a failed test, a teardown abort
# (a rank or pool slot that died after returning its result -- e.g. SIGABRT "terminate called
# without an active exception" at interpreter exit, which the pool's shutdown check reports
# as "exited uncleanly"), a process the run started still alive after it (found by a tag in
# its environment, then killed), or a run past the per-run time limit.
#
#   tools/stress_multirank.sh [--load K] [--parallel P] [N] [PER_RUN_SECONDS] [pytest target...]
#   tools/stress_multirank.sh 30 240 "tests/distributed/test_ddp.py::test_ddp_matches_torch_ddp[3]"
#   tools/stress_multirank.sh --parallel 4 24 900 tests/distributed/test_ddp_experts.py
#   tools/stress_multirank.sh --load 2 6 900 tests/distributed/test_overlap_races.py
#
# Loading the machine shifts the timing of every collective, which is how races between a
# collective in flight and a read of its buffer show up (issue 21):
#   --load K      start K busy-loop processes for the duration of the stress run (killed at
#                 exit, also on Ctrl-C);
#   --parallel P  run P repetitions at a time (each with its own ports and log), so the
#                 runs load each other.
# Exit status 0 only when every run was clean. Logs of unclean runs: $STRESS_LOG_DIR (default
# /tmp/megadlms-stress).
set -u
LOAD=0
PAR=1
while [ $# -gt 0 ]; do
    case "$1" in
        --load) LOAD=$2; shift 2 ;;
        --parallel) PAR=$2; shift 2 ;;
        *) break ;;
    esac
done
case "$LOAD$PAR" in *[!0-9]*) echo "--load and --parallel take a count, e.g. --load 2" >&2; exit 2 ;; esac
[ "$PAR" -ge 1 ] || { echo "--parallel must be at least 1" >&2; exit 2; }
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

LOADERS=()
pids=()
stop_load() {
    for pid in "${LOADERS[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${LOADERS[@]}"; do wait "$pid" 2>/dev/null; done
    LOADERS=()
}
stop_runs() {  # interrupted: the repetitions in flight (their timeout, hence pytest) too
    for pid in "${pids[@]}"; do pkill -TERM -P "$pid" 2>/dev/null; kill "$pid" 2>/dev/null; done
}
trap stop_load EXIT
trap 'stop_runs; stop_load; exit 130' INT TERM
for _ in $(seq 1 "$LOAD"); do
    (while :; do :; done) &
    LOADERS+=($!)
done

tagged() {  # pids of live processes whose environment carries this run's tag
    local tag=$1 f
    for f in /proc/[0-9]*/environ; do
        tr '\0' '\n' 2>/dev/null <"$f" | grep -qx "MEGADLMS_STRESS_RUN=$tag" && basename "$(dirname "$f")"
    done
}

one_run() {  # one repetition; writes its verdict to $LOGS/verdict_$1
    local i=$1 log="$LOGS/run_$1.log" rc tag="$$-$1" leaked="" aborts t
    MEGADLMS_STRESS_RUN=$tag timeout -k 10 "$LIMIT" "$PY" -m pytest -q -x -p no:cacheprovider "${TARGETS[@]}" >"$log" 2>&1
    rc=$?
    # leaked processes: anything started by the run (pool slots, the forkserver, DataLoader
    # workers, launchers) still alive a few seconds after pytest exited; they are killed
    for t in 1 2 3 4 5; do
        leaked=$(tagged "$tag")
        [ -z "$leaked" ] && break
        sleep 1
    done
    if [ -n "$leaked" ]; then
        for p in $leaked; do echo "    leaked: $(tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | cut -c1-160)"; done >>"$log"
        kill -9 $leaked 2>/dev/null
    fi
    # teardown aborts: a rank or slot killed by SIGABRT, or the pool's exit-code check
    aborts=$(grep -c -E "terminate called|exited uncleanly|Aborted|core dumped" "$log")
    if [ $rc -ne 0 ] || [ "$aborts" -ne 0 ] || [ -n "$leaked" ]; then
        echo "run $i: UNCLEAN (rc $rc, $aborts teardown aborts, $(echo $leaked | wc -w) leaked processes) -> $log"
        grep -m5 -E "terminate called|exited uncleanly|Aborted|leaked:|Error|passed|failed" "$log" | sed 's/^/    /'
    else
        echo "run $i: clean ($(tail -1 "$log" | tr -d '='))"
        rm -f "$log"
    fi >"$LOGS/verdict_$i"
}

bad=0
start=$(date +%s)
i=0
while [ $i -lt "$N" ]; do
    first=$((i + 1))
    pids=()
    while [ ${#pids[@]} -lt "$PAR" ] && [ $i -lt "$N" ]; do
        i=$((i + 1))
        one_run $i &
        pids+=($!)
    done
    wait "${pids[@]}"
    for j in $(seq "$first" "$i"); do
        cat "$LOGS/verdict_$j"
        grep -q UNCLEAN "$LOGS/verdict_$j" && bad=$((bad + 1))
        rm -f "$LOGS/verdict_$j"
    done
done
stop_load
echo "stress: $((N - bad))/$N clean runs of ${TARGETS[*]} (parallel $PAR, load $LOAD) in $(($(date +%s) - start)) s"
[ $bad -eq 0 ]
