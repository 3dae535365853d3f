#!/usr/bin/env bash
# Call Q (prepared for the next session): branch wip/gdn-records-weights (snapQ, aotQ built here
# for its head 39a35cf): the full GPU suite, then GDN at batch 8 and 256, FP32, L = 8 and 16, side
# by side with main's kernels (snapFin2/aotFin2). Merge if the suite passes and batch 256 is
# faster with batch 8 level (main, call L2: qwen4b 171.0 / 10.7, qwen122b 315.7 / 18.2 us).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in Q Fin2; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapQ
export REPLAYSSM_AOT_DIR=/tmp/aotQ REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
for t in Fin2 Q; do
  cd $D/snap$t
  export REPLAYSSM_AOT_DIR=/tmp/aot$t REPLAYSSM_GIT_COMMIT=$(cat .commit)
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,256 --windows 16 --window-sweep 8 --states f32 --shapes qwen4b,qwen122b" \
    OUT=$R/gdn-$t timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/gdn-$t.out 2>&1
  grep -E "\('qwen" $R/gdn-$t.out | sed "s/^/$t /" | cut -c1-200
done
cd $OUT && tar czf run.tgz run && rm -rf run
