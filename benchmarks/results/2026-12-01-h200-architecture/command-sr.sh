#!/usr/bin/env bash
# The second device call behind this record (repository root on the H200):
#   bash benchmarks/results/2026-12-01-h200-architecture/command-sr.sh
# 1. test_stochastic_rounding_is_deterministic with JIT allowed (its L = 2 module is not in the
#    h200 preset), 2. the stochastic-rounding modules, whose SASS changed (they read seed_tensor),
#    against main before this work (e05c789: .device/old and its prebuilt SR modules), side by
#    side in alternating processes: benchmarks/bench_sr_sides.py -> $OUT/sr-sides.jsonl.
set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/prelude.sh || exit 1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/replayssm-cache
mkdir -p /tmp/aot && tar xJf .device/aot.tar.xz -C /tmp/aot --strip-components=1
mkdir -p /tmp/old-aot && tar xJf .device/old-aot.tar.xz -C /tmp/old-aot --strip-components=1
REPLAYSSM_AOT_DIR=/tmp/aot PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 -m pytest -q -p no:cacheprovider \
  tests/test_mamba2_gpu.py -k stochastic_rounding_is_deterministic 2>&1 | tail -3
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then root=$PWD/.device/old aot=/tmp/old-aot; else root=$PWD aot=/tmp/aot; fi
    (cd /tmp && REPLAYSSM_AOT_DIR=$aot REPLAYSSM_DISABLE_JIT=1 PYTHONPATH=$root:$PYTHONPATH timeout 150 \
      python3 "$OLDPWD/benchmarks/bench_sr_sides.py" --label "$side-$round" --reps 16) >> "$OUT/sr-sides.jsonl" 2> "$OUT/sr-$side-$round.err"
    echo "$side round $round: rc=$? rows=$(grep -c "\"$side-$round\"" "$OUT/sr-sides.jsonl")"
  done
done
