#!/usr/bin/env bash
# Session 9, call D: wip/pdl-steps with the batch-1 Mamba-2 conventional tile rule (snapP; aotP,
# built here for sm_90a, templates unchanged since call C1): FlashInfer's selective_state_update at
# batch 1 and 8, then the GDN sweep with fla and our Mamba-2 sweep, in one call (JSON kept).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotP ] || { mkdir -p /tmp/aotP && tar xJf $D/aotP.tar.xz -C /tmp/aotP --strip-components=1; }
export DEVICE_DIR=$D
cd $D/snapP
export REPLAYSSM_AOT_DIR=/tmp/aotP REPLAYSSM_GIT_COMMIT=$(cat .commit) REPLAYSSM_DISABLE_JIT=1
R=$OUT/peers; mkdir -p $R
PEER_ARGS="--small-batches 1,8 --big-batches=, --tune-buckets=, --tune-check-batch 0 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 70 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "selective_state_update\[" $R/peers.out | tail -2 | cut -c1-140
(cd $OUT && tar czf peers.tgz peers && rm -rf peers)
R=$OUT/gdn; mkdir -p $R
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 8 --states f32,bf16" \
  OUT=$R timeout 150 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|256), 16, 'f32'" $R/gdn.out | cut -c1-200
(cd $OUT && tar czf gdn.tgz gdn && rm -rf gdn)
R=$OUT/m2; mkdir -p $R
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 8 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R timeout 130 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)[a-z0-9]*', (1|8|256), 16, 'f32'" $R/m2.out | cut -c1-200
(cd $OUT && tar czf m2.tgz m2 && rm -rf m2)
