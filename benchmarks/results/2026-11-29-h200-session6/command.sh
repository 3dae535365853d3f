#!/usr/bin/env bash
# Call FIN2 (final): main with wide rows for Mamba-2's flush-every-step kernel only (snapFin2, aotFin2
# built here for sm_90a): the full GPU suite, then FlashInfer's Mamba-2 peers and our Mamba-2
# sweep in one call. (GDN kernels are unchanged since call L2, whose GDN sweep stands.)
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapFin2
export PYTHONUNBUFFERED=1
[ -d /tmp/aotFin2 ] || { mkdir -p /tmp/aotFin2 && tar xJf $D/aotFin2.tar.xz -C /tmp/aotFin2 --strip-components=1; }
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotFin2 REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 200 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "tuned amortized|selective_state_update\[" $R/peers.out | tail -8 | cut -c1-140
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 150 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)[a-z0-9]*', (1|8|256), (8|16), '(f32|bf16)'" $R/m2.out | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run
