#!/usr/bin/env bash
# Session 10, call D: main (snapB; aotB, built here for sm_90a): the full GPU suite; FlashInfer's
# Mamba-2 peers (selective_state_update at batch 1 and 8; selective_state_update and
# checkpointing_ssu, default and autotuned, at batch 64 and 256); then the GDN sweep with fla and
# our Mamba-2 sweep, in one call (JSON kept).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 DEVICE_DIR=$D
[ -d /tmp/aotB ] || { mkdir -p /tmp/aotB && tar xJf $D/aotB.tar.xz -C /tmp/aotB --strip-components=1; }
cd $D/snapB
export REPLAYSSM_AOT_DIR=/tmp/aotB REPLAYSSM_GIT_COMMIT=$(cat .commit)
R=$OUT/tests; mkdir -p $R
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R timeout 240 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -8 | cut -c1-250
(cd $OUT && tar czf tests.tgz tests && rm -rf tests)
export REPLAYSSM_DISABLE_JIT=1
R=$OUT/peers; mkdir -p $R
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 140 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "tuned amortized|selective_state_update\[" $R/peers.out | tail -8 | cut -c1-140
(cd $OUT && tar czf peers.tgz peers && rm -rf peers)
R=$OUT/gdn; mkdir -p $R
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 8 --states f32,bf16" \
  OUT=$R timeout 160 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|256), 16, 'f32'" $R/gdn.out | cut -c1-200
(cd $OUT && tar czf gdn.tgz gdn && rm -rf gdn)
R=$OUT/m2; mkdir -p $R
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 8 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R timeout 140 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)[a-z0-9]*', (1|8|256), 16, 'f32'" $R/m2.out | cut -c1-200
(cd $OUT && tar czf m2.tgz m2 && rm -rf m2)
