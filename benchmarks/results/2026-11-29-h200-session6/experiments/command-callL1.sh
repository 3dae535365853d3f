#!/usr/bin/env bash
# Call L1: branch wip/records-l2 (snapL, aotL): the full GPU suite, then batch 256 FP32 at L = 8
# and 16 side by side with main's kernels (snapP/aotP: the same records kernels as main).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in L P; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
cd $D/snapL
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotL REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
for round in 1; do for t in P L; do
  cd $D/snap$t
  export REPLAYSSM_AOT_DIR=/tmp/aot$t REPLAYSSM_GIT_COMMIT=$(cat .commit)
  BENCH_ARGS="--reps 8 --batches 256 --windows 16 --window-sweep 8 --states f32 --shapes super120b,nano4b" \
    OUT=$R/m2-$t$round timeout 100 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2-$t$round.out 2>&1
  grep -E "\('(super|nano)" $R/m2-$t$round.out | sed "s/^/$t$round /" | cut -c1-200
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 256 --windows 16 --window-sweep 8 --states f32 --shapes qwen4b,qwen122b" \
    OUT=$R/gdn-$t$round timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/gdn-$t$round.out 2>&1
  grep -E "\('qwen" $R/gdn-$t$round.out | sed "s/^/$t$round /" | cut -c1-200
done; done
cd $OUT && tar czf run.tgz run && rm -rf run
