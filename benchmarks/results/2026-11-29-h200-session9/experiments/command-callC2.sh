#!/usr/bin/env bash
# Session 9, call C2: wip/pdl-steps (snapP: programmatic launches for the per-item kernels only;
# aotP, built here for sm_90a): FlashInfer's Mamba-2 peers and our conventional row tiles at batch 1
# and 8, then the GDN sweep with fla and our Mamba-2 sweep, side by side in one call.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotP ] || { mkdir -p /tmp/aotP && tar xJf $D/aotP.tar.xz -C /tmp/aotP --strip-components=1; }
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapP
export REPLAYSSM_AOT_DIR=/tmp/aotP REPLAYSSM_GIT_COMMIT=$(cat .commit) REPLAYSSM_DISABLE_JIT=1
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 130 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "tuned amortized|selective_state_update\[" $R/peers.out | tail -8 | cut -c1-140
BENCH_ARGS="--reps 8 --batches none --window-sweep 16 --window-sweep-batch 8 --states f32 --shapes super120b --tiling-sweep super120b:1:16:f32,super120b:8:16:f32,nano4b:1:16:f32,nano4b:8:16:f32" \
  OUT=$R/m2tile timeout 70 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2tile.out 2>&1
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['shape'],r['batch'],r['kernel'],round(r['us'],2)) for r in d['rows'] if 'conv' in r['kernel']]" $R/m2tile/mamba2.json
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 8 --states f32,bf16" \
  OUT=$R/gdn timeout 170 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|256), (8|16), '(f32|bf16)'" $R/gdn.out | cut -c1-230
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 8 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 150 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)[a-z0-9]*', (1|8|256), (8|16), 'f32'" $R/m2.out | cut -c1-230
