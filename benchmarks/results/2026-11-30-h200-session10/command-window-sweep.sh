#!/usr/bin/env bash
# Session 10, call E: main's kernels (snapB, aotB as in call D): the window sweep L = 4, 8, 16, 32
# at batch 256, FP32 and BF16 checkpoints, both families (fla is independent of L: call D).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 DEVICE_DIR=$D
[ -d /tmp/aotB ] || { mkdir -p /tmp/aotB && tar xJf $D/aotB.tar.xz -C /tmp/aotB --strip-components=1; }
cd $D/snapB
export REPLAYSSM_AOT_DIR=/tmp/aotB REPLAYSSM_GIT_COMMIT=$(cat .commit) REPLAYSSM_DISABLE_JIT=1
R=$OUT/lsweep; mkdir -p $R/gdn $R/m2
GDN_BENCH_ARGS="--reps 8 --no-fla --shapes qwen4b,qwen122b --batches none --window-sweep 4,8,16,32 --states f32,bf16" \
  OUT=$R/gdn timeout 200 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen" $R/gdn.out | cut -c1-120
BENCH_ARGS="--reps 8 --shapes super120b,nano4b --batches none --window-sweep 4,8,16,32 --states f32,bf16" \
  OUT=$R/m2 timeout 200 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)" $R/m2.out | cut -c1-120
cd $OUT && tar czf lsweep.tgz lsweep && rm -rf lsweep
