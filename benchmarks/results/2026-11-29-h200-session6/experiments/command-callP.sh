#!/usr/bin/env bash
# Call P (prepared for the next session): branch wip/flush-every-step-predict (snapP, aotP built
# here for its head): the full GPU suite, then batch 1, 8, 256 at L = 16 (FP32 and BF16) for both
# families. Merge the branch if the suite passes and batch 1 is faster (main, call F3: super120b
# 6.0, nano4b 5.9, qwen4b 5.0, qwen122b 6.1 us) with batch 256 level.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapP
export PYTHONUNBUFFERED=1
[ -d /tmp/aotP ] || { mkdir -p /tmp/aotP && tar xJf $D/aotP.tar.xz -C /tmp/aotP --strip-components=1; }
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotP REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
BENCH_ARGS="--reps 8 --batches 1,8,256 --windows 16 --window-sweep 16 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 120 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)" $R/m2.out | cut -c1-200
GDN_BENCH_ARGS="--reps 8 --no-fla --batches 1,8,256 --windows 16 --window-sweep 16 --states f32,bf16 --shapes qwen4b,qwen122b" \
  OUT=$R/gdn timeout 120 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen" $R/gdn.out | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run
