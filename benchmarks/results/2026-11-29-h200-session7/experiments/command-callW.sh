#!/usr/bin/env bash
# Call W: branch wip/gdn-records-warps (snapW, aotW built here for sm_90a): GDN's split records
# kernel runs 4-warp CTAs from 8 records CTAs per SM. Full GPU suite (with the 4-warp bitwise
# tests), then the GDN sweep (fla side by side) for main (snapQ/aotQ) and for W, one after the
# other in the same call; then W with the warp count forced (4, 8) around the threshold.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in Q W; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapW
export REPLAYSSM_AOT_DIR=/tmp/aotW REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
for t in Q W; do
  cd $D/snap$t
  export REPLAYSSM_AOT_DIR=/tmp/aot$t REPLAYSSM_GIT_COMMIT=$(cat .commit)
  GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
    OUT=$R/gdn-$t timeout 200 bash benchmarks/h200_run.sh bench-gdn > $R/gdn-$t.out 2>&1
  grep -E "\('qwen[0-9]*b', (8|64|256), (8|16), 'f32'" $R/gdn-$t.out | sed "s/^/$t /" | cut -c1-210
done
cd $D/snapW; export REPLAYSSM_AOT_DIR=/tmp/aotW REPLAYSSM_GIT_COMMIT=$(cat .commit)
for n in 4 8; do
  REPLAYSSM_GDN_RECORDS_WARPS=$n GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,32,64,128 --windows 16 --states f32 --shapes qwen4b,qwen122b" \
    OUT=$R/w$n timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/w$n.out 2>&1
  grep -E "\('qwen" $R/w$n.out | sed "s/^/warps=$n /" | cut -c1-200
done
cd $OUT && tar czf run.tgz run && rm -rf run
