#!/usr/bin/env bash
# Session 9, call A: branch wip/gdn-overlapped (snapO, aotO built here for sm_90a): the full GPU
# suite (with the overlapped kernel's bitwise tests); GDN split against overlapped, alternating,
# twice; FlashInfer's selective_state_update at batch 1-32 next to our Mamba-2 conventional row
# tiles at the same batches.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotO ] || { mkdir -p /tmp/aotO && tar xJf $D/aotO.tar.xz -C /tmp/aotO --strip-components=1; }
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapO
export REPLAYSSM_AOT_DIR=/tmp/aotO REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 280 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -8 | cut -c1-250
export REPLAYSSM_DISABLE_JIT=1
for round in 1 2; do for k in split overlapped; do
  REPLAYSSM_REPLAY_KERNEL=$k GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,64,256 --windows 16 --window-sweep 16 --states f32,bf16 --shapes qwen4b,qwen122b" \
    OUT=$R/$k$round timeout 110 bash benchmarks/h200_run.sh bench-gdn > $R/$k$round.out 2>&1
  grep -E "\('qwen" $R/$k$round.out | sed "s/^/$k$round /" | cut -c1-260
done; done
PEER_ARGS="--small-batches 1,8,16,32 --big-batches=, --tune-buckets=, --tune-check-batch 0 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 120 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "selective_state_update\[" $R/peers.out | tail -8 | cut -c1-160
BENCH_ARGS="--reps 8 --batches none --window-sweep 16 --window-sweep-batch 8 --states f32 --shapes super120b --tiling-sweep super120b:1:16:f32,super120b:8:16:f32,super120b:16:16:f32,super120b:32:16:f32,nano4b:8:16:f32,nano4b:16:16:f32,nano4b:32:16:f32" \
  OUT=$R/m2tile timeout 150 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2tile.out 2>&1
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['shape'],r['batch'],r['kernel'],round(r['us'],2)) for r in d['rows'] if 'conv' in r['kernel']]" $R/m2tile/mamba2.json
cd $OUT && tar czf run.tgz run && rm -rf run
