#!/usr/bin/env bash
# Session 9, call B: branch wip/gdn-records-two-kheads (snapK, aotK built here for sm_90a): the full
# GPU suite; GDN records CTAs of one and of two key heads (REPLAYSSM_GDN_RECORDS_KEY_HEADS) side by
# side, alternating, twice; then the GDN sweep with fla (default choices) and per-kernel times.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotK ] || { mkdir -p /tmp/aotK && tar xJf $D/aotK.tar.xz -C /tmp/aotK --strip-components=1; }
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapK
export REPLAYSSM_AOT_DIR=/tmp/aotK REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 280 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -8 | cut -c1-250
export REPLAYSSM_DISABLE_JIT=1
for round in 1 2; do for kh in 1 2; do
  REPLAYSSM_GDN_RECORDS_KEY_HEADS=$kh GDN_BENCH_ARGS="--reps 8 --no-fla --batches 64,128,256 --windows 16 --window-sweep 32 --states f32,bf16 --shapes qwen4b,qwen122b" \
    OUT=$R/kh$kh-$round timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/kh$kh-$round.out 2>&1
  grep -E "\('qwen" $R/kh$kh-$round.out | sed "s/^/kh$kh-$round /" | cut -c1-200
done; done
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 200 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|256), (8|16), '(f32|bf16)'" $R/gdn.out | cut -c1-230
source $D/prelude.sh >/dev/null 2>&1
( export PYTHONPATH=$PWD:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc
  timeout 80 python3 benchmarks/profile_steps.py --family gdn --shapes qwen4b,qwen122b --out $R/prof > $R/prof.out 2>&1 )
grep "step" $R/prof.out | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run
