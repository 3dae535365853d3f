#!/usr/bin/env bash
# Session 8, call G: GDN FP16 checkpoints (main, snapI; aotH plus aotF16: the six FP16 modules,
# built here for sm_90a): the low-precision GPU tests of both families with their errors printed,
# then the capped-register state kernel forced off and on at batch 8-256 with FP16 checkpoints.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in H F16; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapI
export REPLAYSSM_AOT_DIR=/tmp/aotH:/tmp/aotF16 REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="-k low_precision -s" OUT=$R/tests timeout 150 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "state=|passed|failed|Error" $R/tests.out | cut -c1-200
export REPLAYSSM_DISABLE_JIT=1
for c in 0 1; do
  REPLAYSSM_GDN_CAPPED_STATE_REGISTERS=$c GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,16,32,64,256 --windows 16 --window-sweep 16 --states f16 --shapes qwen4b,qwen122b" \
    OUT=$R/capped$c timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/capped$c.out 2>&1
  grep -E "\('qwen" $R/capped$c.out | sed "s/^/capped=$c /" | cut -c1-200
done
cd $OUT && tar czf run.tgz run && rm -rf run
