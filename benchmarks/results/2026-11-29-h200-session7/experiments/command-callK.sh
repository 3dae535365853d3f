#!/usr/bin/env bash
# Call K: branch wip/gdn-flush-float-k (snapK, aotK built here for sm_90a): GDN's split state
# kernel converts k, q, v to FP32 once per CTA (registers of the 64-row tile 117 -> 96). Full GPU
# suite, then GDN A/B against main (snapF/aotW) at batch 8 and 256, L = 8 and 16, FP32 and BF16
# checkpoints; then K's GDN sweep with fla (the final GDN tables if merged). Merge if the suite passes and batch 256 is faster with batch 8 level.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in W K; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapK
export REPLAYSSM_AOT_DIR=/tmp/aotK REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="--maxfail=10 --durations=3" OUT=$R/tests timeout 175 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
for t in F K; do
  cd $D/snap$t; a=$t; [ $t = F ] && a=W
  export REPLAYSSM_AOT_DIR=/tmp/aot$a REPLAYSSM_GIT_COMMIT=$(cat .commit)
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,256 --windows 16 --window-sweep 8 --states f32 --shapes qwen4b,qwen122b" \
    OUT=$R/ab-gdn-$t timeout 50 bash benchmarks/h200_run.sh bench-gdn > $R/ab-gdn-$t.out 2>&1
  grep -E "\('qwen" $R/ab-gdn-$t.out | grep -v "bf16', 8\|, 8, 16, 'bf16'" | sed "s/^/$t /" | cut -c1-200
done
cd $D/snapK; export REPLAYSSM_AOT_DIR=/tmp/aotK REPLAYSSM_GIT_COMMIT=$(cat .commit)
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 110 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|256), (8|16), 'f32'" $R/gdn.out | cut -c1-210
