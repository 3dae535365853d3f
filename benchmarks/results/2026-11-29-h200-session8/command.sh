#!/usr/bin/env bash
# Session 8, final call 1: main ec3db79 (snapH, aotH built here for sm_90a): the full GPU suite,
# then GDN's capped-register state kernel forced off and on (REPLAYSSM_GDN_CAPPED_STATE_REGISTERS)
# at batch 16-128, side by side, to place the batch from which it is chosen.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotH ] || { mkdir -p /tmp/aotH && tar xJf $D/aotH.tar.xz -C /tmp/aotH --strip-components=1; }
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapH
export REPLAYSSM_AOT_DIR=/tmp/aotH REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="--maxfail=10 --durations=3" OUT=$R/tests timeout 240 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -6 | cut -c1-250
export REPLAYSSM_DISABLE_JIT=1
for c in 0 1; do
  REPLAYSSM_GDN_CAPPED_STATE_REGISTERS=$c GDN_BENCH_ARGS="--reps 8 --no-fla --batches 16,32,64,128 --windows 16 --window-sweep 16 --window-sweep-batch 128 --states f32,bf16 --shapes qwen4b,qwen122b" \
    OUT=$R/capped$c timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/capped$c.out 2>&1
  grep -E "\('qwen" $R/capped$c.out | sed "s/^/capped=$c /" | cut -c1-200
done
cd $OUT && tar czf run.tgz run && rm -rf run

#!/usr/bin/env bash
# Session 8, final call 2: main 4a5ea92 (snapH; aotH built at ec3db79, templates unchanged since): the GDN sweep with fla side by side (with the
# staggered cycle), then the per-kernel times of a step (profile_steps) at batch 256, L = 16.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotH ] || { mkdir -p /tmp/aotH && tar xJf $D/aotH.tar.xz -C /tmp/aotH --strip-components=1; }
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapH
export REPLAYSSM_AOT_DIR=/tmp/aotH REPLAYSSM_GIT_COMMIT=$(cat .commit)
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 300 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|256), (8|16), '(f32|bf16)'" $R/gdn.out | cut -c1-230
source $D/prelude.sh >/dev/null 2>&1
( export PYTHONPATH=$PWD:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc
  timeout 80 python3 benchmarks/profile_steps.py --family gdn --shapes qwen4b,qwen122b --out $R/prof > $R/prof.out 2>&1 )
grep "step" $R/prof.out | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run

#!/usr/bin/env bash
# Session 8, final call 3: main 4a5ea92 (snapH, aotH): FlashInfer's Mamba-2 peers, then our
# Mamba-2 sweep (with the staggered cycle), side by side in one call.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotH ] || { mkdir -p /tmp/aotH && tar xJf $D/aotH.tar.xz -C /tmp/aotH --strip-components=1; }
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapH
export REPLAYSSM_AOT_DIR=/tmp/aotH REPLAYSSM_GIT_COMMIT=$(cat .commit)
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 220 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "tuned amortized|selective_state_update\[" $R/peers.out | tail -8 | cut -c1-140
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 180 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)[a-z0-9]*', (1|8|256), (8|16), 'f32'" $R/m2.out | cut -c1-230
cd $OUT && tar czf run.tgz run && rm -rf run
