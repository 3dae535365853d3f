#!/usr/bin/env bash
# Call WR: ReplaySSM kernels with wide rows (snapWR, aotWR: the four L = 16 FP32 bench specs)
# against main (snapL2, aotL2) at batch 1, 8 and 256, side by side.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in L2 WR; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
for t in L2 WR; do
  cd $D/snap$t
  export REPLAYSSM_AOT_DIR=/tmp/aot$t REPLAYSSM_GIT_COMMIT=$(cat .commit)
  BENCH_ARGS="--reps 8 --batches 1,8,256 --windows 16 --window-sweep 16 --states f32 --shapes super120b,nano4b" \
    OUT=$R/m2-$t timeout 100 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2-$t.out 2>&1
  grep -E "\('(super|nano)" $R/m2-$t.out | sed "s/^/$t /" | cut -c1-200
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 1,8,256 --windows 16 --window-sweep 16 --states f32 --shapes qwen4b,qwen122b" \
    OUT=$R/gdn-$t timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/gdn-$t.out 2>&1
  grep -E "\('qwen" $R/gdn-$t.out | sed "s/^/$t /" | cut -c1-200
done
cd $OUT && tar czf run.tgz run && rm -rf run
