#!/usr/bin/env bash
# One H200 call: each boundary's sweep under its own time limit (a crash or a hang in one does not
# stop the others), then the GPU tests of the kernels this session changed. Everything lands in
# $OUT: <name>.json / <name>_sweep.json from each script, logs.tgz with every log.
# Usage (repo root, wheels set up):
#   bash benchmarks/h200_session3/run_sweeps.sh SWEEP_S TEST_S "SWEEPS" "PYTEST ARGS"
set -u
SWEEP_S=${1:-100}
TEST_S=${2:-150}
SWEEPS=${3:-"route mla kda moe"}
TESTS=${4:-"-m gpu tests"}
mkdir -p /tmp/logs
for name in $SWEEPS; do
    t0=$SECONDS
    timeout "$SWEEP_S" python3 "benchmarks/h200_session3/${name}_sweep.py" >"/tmp/logs/${name}.log" 2>&1
    echo "${name}: rc=$? $((SECONDS - t0)) s"
    tar czf "$OUT/.logs.tgz" -C /tmp logs && mv "$OUT/.logs.tgz" "$OUT/logs.tgz"
done
t0=$SECONDS
eval "timeout $TEST_S python3 -m pytest -q -p no:cacheprovider $TESTS" >/tmp/logs/gpu_tests.log 2>&1
echo "gpu tests: rc=$? $((SECONDS - t0)) s"
tail -15 /tmp/logs/gpu_tests.log
tar czf "$OUT/.logs.tgz" -C /tmp logs && mv "$OUT/.logs.tgz" "$OUT/logs.tgz"
