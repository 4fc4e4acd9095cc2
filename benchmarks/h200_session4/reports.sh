#!/usr/bin/env bash
# The committed H200 reports: each named notebook through `k3lab run` (kimi-k3, tp 8) under its
# own time limit, into executed/h200; after each one the whole folder is re-packed into
# $OUT/reports.tgz (atomically), so a later hang loses nothing. Per-notebook parameters are the
# ones the committed reports use (20_moe: tokens 1 / 4 / 16 in its sweep; 90_decode_step: 8k
# context at 32 fixed splits).
# Usage (repo root, wheels set up, K3LAB_GIT_COMMIT exported):
#   bash benchmarks/h200_session4/reports.sh "10_route 20_moe ..." [SECONDS_EACH]
set -u
LIMIT=${2:-300}
pack() { tar czf "$OUT/.reports.tgz" executed/h200 && mv "$OUT/.reports.tgz" "$OUT/reports.tgz"; }
for name in $1; do
    case $name in
        20_moe) params=(-p "sweep_tokens=[1,4,16]") ;;
        90_decode_step) params=(-p context=8192 -p num_splits=32) ;;
        *) params=() ;;
    esac
    t0=$SECONDS
    timeout "$LIMIT" k3lab run "$name" --device cuda --preset kimi-k3 --tp 8 \
        --out executed/h200 "${params[@]}" 2>&1 | tail -3
    echo "${name}: $((SECONDS - t0)) s"
    pack
done
