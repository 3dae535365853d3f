#!/usr/bin/env bash
# Session 10, call A: main with the one-load cursor read (snapA, aotA built here for sm_90a): the
# full GPU suite; then batch 1 and 8, FP32, L = 16, both families, new (snapA) against session 9's
# call D build (snapP/aotP) alternating, two rounds; FlashInfer's selective_state_update at 1 and 8.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 DEVICE_DIR=$D
for t in A P; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
cd $D/snapA
REPLAYSSM_AOT_DIR=/tmp/aotA REPLAYSSM_GIT_COMMIT=$(cat .commit) PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests \
  timeout 260 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -8 | cut -c1-250
export REPLAYSSM_DISABLE_JIT=1
small() {  # tag snapshot
  cd $D/snap$2
  export REPLAYSSM_AOT_DIR=/tmp/aot$2 REPLAYSSM_GIT_COMMIT=$(cat .commit)
  BENCH_ARGS="--reps 8 --batches 1,8 --windows 16 --window-sweep 16 --states f32 --shapes super120b,nano4b" \
    OUT=$R/m2-$1 timeout 60 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2-$1.out 2>&1
  grep -E "\('(super|nano)" $R/m2-$1.out | sed "s/^/$1 /" | cut -c1-170
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 1,8 --windows 16 --window-sweep 16 --states f32 --shapes qwen4b,qwen122b" \
    OUT=$R/gdn-$1 timeout 60 bash benchmarks/h200_run.sh bench-gdn > $R/gdn-$1.out 2>&1
  grep -E "\('qwen" $R/gdn-$1.out | sed "s/^/$1 /" | cut -c1-170
}
small new1 A; small old1 P; small new2 A; small old2 P
cd $D/snapA
PEER_ARGS="--small-batches 1,8 --big-batches=, --tune-buckets=, --tune-check-batch 0 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 60 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "selective_state_update\[" $R/peers.out | tail -4 | cut -c1-140
cd $OUT && tar czf run.tgz run && rm -rf run
