#!/usr/bin/env bash
# Call F (final, session 7): main (snapF; its kernels are aotW's, built here for sm_90a at
# 7996123, templates unchanged since): the GDN sweep with fla side by side, and the per-kernel
# times of a step (profile_steps) at batch 256, L = 16; then FlashInfer's Mamba-2 peers and our
# Mamba-2 sweep (kernels unchanged since session 6).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotW ] || { mkdir -p /tmp/aotW && tar xJf $D/aotW.tar.xz -C /tmp/aotW --strip-components=1; }
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapF
export REPLAYSSM_AOT_DIR=/tmp/aotW REPLAYSSM_GIT_COMMIT=$(cat .commit)
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 200 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|64|256), (8|16), 'f32'" $R/gdn.out | cut -c1-210
source $D/prelude.sh >/dev/null 2>&1
( export PYTHONPATH=$PWD:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc
  timeout 90 python3 benchmarks/profile_steps.py --family gdn --shapes qwen4b,qwen122b --out $R/prof > $R/prof.out 2>&1 )
grep "step" $R/prof.out | cut -c1-200
cd $D/snapF
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 200 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "tuned amortized|selective_state_update\[" $R/peers.out | tail -8 | cut -c1-140
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 150 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)[a-z0-9]*', (1|8|256), (8|16), 'f32'" $R/m2.out | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run
