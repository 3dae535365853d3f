#!/usr/bin/env bash
# Call S: branch wip/gdn-sums-in-state (snapS, aotS built here for sm_90a): the GDN state kernel
# forms its rows' record sums from the held u rows itself; the records kernel hands over only the
# per-record weights. Full GPU suite; GDN A/B against main (snapQ/aotQ, same GDN kernels as main)
# at batch 1, 8, 256, FP32, L = 8 and 16; per-kernel times of S at batch 256; then S's full GDN
# sweep with fla side by side (the results if S is merged).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in Q S; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapS
export REPLAYSSM_AOT_DIR=/tmp/aotS REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
for t in Q S; do
  cd $D/snap$t
  export REPLAYSSM_AOT_DIR=/tmp/aot$t REPLAYSSM_GIT_COMMIT=$(cat .commit)
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 1,8,256 --windows 16 --window-sweep 8 --states f32 --shapes qwen4b,qwen122b" \
    OUT=$R/ab-gdn-$t timeout 120 bash benchmarks/h200_run.sh bench-gdn > $R/ab-gdn-$t.out 2>&1
  grep -E "\('qwen" $R/ab-gdn-$t.out | sed "s/^/$t /" | cut -c1-200
done
cd $D/snapS; export REPLAYSSM_AOT_DIR=/tmp/aotS REPLAYSSM_GIT_COMMIT=$(cat .commit)
source $D/prelude.sh >/dev/null 2>&1
( export PYTHONPATH=$PWD:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc
  timeout 90 python3 benchmarks/profile_steps.py --family gdn --shapes qwen4b,qwen122b --out $R/prof > $R/prof.out 2>&1 )
tail -20 $R/prof.out | cut -c1-200
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 200 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|256), (8|16), 'f32'" $R/gdn.out | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run
