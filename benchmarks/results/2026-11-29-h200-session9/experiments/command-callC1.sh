#!/usr/bin/env bash
# Session 9, call C1: wip/pdl-steps (snapP, aotP built here for sm_90a): the full GPU suite; each
# step's first kernel launched as a programmatic dependent of the previous kernel (default) against
# plain launches (REPLAYSSM_OVERLAP_PRIOR_KERNEL=0), alternating, at batch 1, 8, 64 (twice) and 256
# (once), FP32, L = 16, both families; FlashInfer's selective_state_update at batch 1 and 8.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotP ] || { mkdir -p /tmp/aotP && tar xJf $D/aotP.tar.xz -C /tmp/aotP --strip-components=1; }
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapP
export REPLAYSSM_AOT_DIR=/tmp/aotP REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 250 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -8 | cut -c1-250
export REPLAYSSM_DISABLE_JIT=1
ab() {  # tag batches
  for o in 1 0; do
    REPLAYSSM_OVERLAP_PRIOR_KERNEL=$o BENCH_ARGS="--reps 8 --batches $2 --windows 16 --window-sweep 16 --states f32 --shapes super120b,nano4b" \
      OUT=$R/m2-$1-o$o timeout 60 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2-$1-o$o.out 2>&1
    grep -E "\('(super|nano)" $R/m2-$1-o$o.out | sed "s/^/o$o /" | cut -c1-170
    REPLAYSSM_OVERLAP_PRIOR_KERNEL=$o GDN_BENCH_ARGS="--reps 8 --no-fla --batches $2 --windows 16 --window-sweep 16 --states f32 --shapes qwen4b,qwen122b" \
      OUT=$R/gdn-$1-o$o timeout 60 bash benchmarks/h200_run.sh bench-gdn > $R/gdn-$1-o$o.out 2>&1
    grep -E "\('qwen" $R/gdn-$1-o$o.out | sed "s/^/o$o /" | cut -c1-170
  done
}
ab r1 1,8,64; ab r2 1,8,64; ab big 256
PEER_ARGS="--small-batches 1,8 --big-batches=, --tune-buckets=, --tune-check-batch 0 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 60 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "selective_state_update\[" $R/peers.out | tail -4 | cut -c1-140
cd $OUT && tar czf run.tgz run && rm -rf run
