#!/usr/bin/env bash
# One H200 call: each "script:seconds" under its own time limit (a crash or hang in one does not
# stop the others), then pytest with the given args and limit. Logs and results land in $OUT
# (results as each script's dump; every log in logs.tgz, re-packed after each step).
# Usage (repo root, wheels set up):
#   bash benchmarks/next/run_next.sh "a.py:150 b.py:100" TEST_S "PYTEST ARGS"
set -u
mkdir -p /tmp/logs
pack() { tar czf "$OUT/.logs.tgz" -C /tmp logs && mv "$OUT/.logs.tgz" "$OUT/logs.tgz"; }
for item in $1; do
    script=${item%%:*}; limit=${item##*:}; name=$(basename "$script" .py)
    t0=$SECONDS
    timeout "$limit" python3 "$script" >"/tmp/logs/${name}.log" 2>&1
    echo "${name}: rc=$? $((SECONDS - t0)) s"
    pack
done
if [ -n "${3:-}" ]; then
    t0=$SECONDS
    eval "timeout ${2:-120} python3 -m pytest -q -p no:cacheprovider $3" >/tmp/logs/gpu_tests.log 2>&1
    echo "gpu tests: rc=$? $((SECONDS - t0)) s"
    tail -15 /tmp/logs/gpu_tests.log
    pack
fi
