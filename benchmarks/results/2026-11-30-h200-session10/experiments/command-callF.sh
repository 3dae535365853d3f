#!/usr/bin/env bash
# Session 10, call F: main's kernels (snapB, aotB): every compiled row tile at batch 1 (and 8), FP32,
# L = 16, both families: conventional, flush-every-step and split steps per tile, two rounds.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 DEVICE_DIR=$D
[ -d /tmp/aotB ] || { mkdir -p /tmp/aotB && tar xJf $D/aotB.tar.xz -C /tmp/aotB --strip-components=1; }
cd $D/snapB
export REPLAYSSM_AOT_DIR=/tmp/aotB REPLAYSSM_GIT_COMMIT=$(cat .commit) REPLAYSSM_DISABLE_JIT=1
R=$OUT/tiles; mkdir -p $R
for r in 1 2; do
  BENCH_ARGS="--reps 8 --batches none --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes super120b,nano4b --tiling-sweep super120b:1:16:f32,nano4b:1:16:f32" \
    OUT=$R/m2-$r timeout 80 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2-$r.out 2>&1
  grep -E "@" $R/m2-$r.out | tail -2 | cut -c1-900
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches none --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes qwen4b,qwen122b --tiling-sweep qwen4b:1:16:f32,qwen122b:1:16:f32" \
    OUT=$R/gdn-$r timeout 80 bash benchmarks/h200_run.sh bench-gdn > $R/gdn-$r.out 2>&1
  grep -E "@" $R/gdn-$r.out | tail -2 | cut -c1-900
done
cd $OUT && tar czf tiles.tgz tiles && rm -rf tiles
