#!/usr/bin/env bash
# Session 10, call C: the per-item ReplaySSM kernels at batch 1 and 8, FP32, L = 16, both families,
# three builds alternating, two rounds: session 9's (snapP/aotP), main's one 8-byte cursor load
# (snapA/aotA), and that plus the flush-every-step kernels preparing the token for no held records
# before the cursor read is back (snapW/aotW: the cursor checked once the preparation is done).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 DEVICE_DIR=$D
for t in A P W; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export REPLAYSSM_DISABLE_JIT=1
small() {  # tag snapshot
  cd $D/snap$2
  export REPLAYSSM_AOT_DIR=/tmp/aot$2 REPLAYSSM_GIT_COMMIT=$(cat .commit)
  BENCH_ARGS="--reps 8 --batches 1,8 --windows 16 --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes super120b,nano4b" \
    OUT=$R/m2-$1 timeout 50 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2-$1.out 2>&1
  grep -E "\('(super|nano)" $R/m2-$1.out | sed "s/^/$1 /" | cut -c1-110
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 1,8 --windows 16 --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes qwen4b,qwen122b" \
    OUT=$R/gdn-$1 timeout 50 bash benchmarks/h200_run.sh bench-gdn > $R/gdn-$1.out 2>&1
  grep -E "\('qwen" $R/gdn-$1.out | sed "s/^/$1 /" | cut -c1-110
}
small W1 W; small A1 A; small P1 P; small P2 P; small A2 A; small W2 W
cd $OUT && tar czf run.tgz run && rm -rf run
