#!/usr/bin/env bash
# Call L2 (final): main with the records kernels' held rows through L2 where they would cap
# residency (snapL2, aotL2 built here for sm_90a): the full GPU suite, then FlashInfer's Mamba-2
# peers and our Mamba-2 and GDN sweeps (fla side by side) in one call. Between them, an A/B at
# batch 8 and 256, FP32, L = 8 and 16: these kernels against records CTAs of 4 warps (snapW4,
# aotW4: only those specs).
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapL2
export PYTHONUNBUFFERED=1
[ -d /tmp/aotL2 ] || { mkdir -p /tmp/aotL2 && tar xJf $D/aotL2.tar.xz -C /tmp/aotL2 --strip-components=1; }
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotL2 REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
[ -d /tmp/aotW4 ] || { mkdir -p /tmp/aotW4 && tar xJf $D/aotW4.tar.xz -C /tmp/aotW4 --strip-components=1; }
for t in L2 W4; do
  cd $D/snap$t
  export REPLAYSSM_AOT_DIR=/tmp/aot$t REPLAYSSM_GIT_COMMIT=$(cat .commit)
  BENCH_ARGS="--reps 8 --batches 8,256 --windows 16 --window-sweep 8 --states f32 --shapes super120b,nano4b" \
    OUT=$R/ab-m2-$t timeout 100 bash benchmarks/h200_run.sh bench-mamba2 > $R/ab-m2-$t.out 2>&1
  grep -E "\('(super|nano)" $R/ab-m2-$t.out | sed "s/^/$t /" | cut -c1-200
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,256 --windows 16 --window-sweep 8 --states f32 --shapes qwen4b,qwen122b" \
    OUT=$R/ab-gdn-$t timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/ab-gdn-$t.out 2>&1
  grep -E "\('qwen" $R/ab-gdn-$t.out | sed "s/^/$t /" | cut -c1-200
done
cd $S; export REPLAYSSM_AOT_DIR=/tmp/aotL2 REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 200 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "tuned amortized|selective_state_update\[" $R/peers.out | tail -8 | cut -c1-140
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 150 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)[a-z0-9]*', (1|8|256), (8|16), 'f32'" $R/m2.out | cut -c1-200
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 150 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|256), (8|16), 'f32'" $R/gdn.out | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run
