#!/usr/bin/env bash
# Session 8, call M: GDN split state kernel's 64-row tile with __launch_bounds__ asking for 5 CTAs
# per SM (wip/gdn-state-minblocks~1 03b6a25: 96 registers, no spills; main 117 FP32 / 127 BF16
# checkpoints, 4 CTAs per SM) against main 179525d (snapG/aotG), side by side: qwen4b and
# qwen122b, batch 8 and 256, L = 16, FP32 and BF16 checkpoints. (Call N's BF16 gain came with
# 95 registers.)
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in G M5; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
for t in G M5 G M5; do
  cd $D/snap$t
  export REPLAYSSM_AOT_DIR=/tmp/aot$t REPLAYSSM_GIT_COMMIT=$(cat .commit) REPLAYSSM_DISABLE_JIT=1
  n=$(ls -d $R/ab-$t-* 2>/dev/null | wc -l)
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,256 --windows 16 --window-sweep 16 --states f32,bf16 --shapes qwen4b,qwen122b" \
    OUT=$R/ab-$t-$n timeout 70 bash benchmarks/h200_run.sh bench-gdn > $R/ab-$t-$n.out 2>&1
  grep -E "\('qwen" $R/ab-$t-$n.out | sed "s/^/$t /" | cut -c1-230
done
cd $OUT && tar czf run.tgz run && rm -rf run
