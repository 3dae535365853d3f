#!/usr/bin/env bash
# Call T: branch wip/gdn-streamed-split (snapT, aotT built here for sm_90a): GDN's records kernel
# runs a few persistent CTAs per SM and hands rows to the state kernel one by one (per-row flag),
# so that the state kernel streams while records are replayed. GDN GPU tests first (short
# timeout: a hand-over bug would hang), then the rest of the suite; GDN A/B against main
# (snapQ/aotQ) at batch 1, 8, 256, FP32, L = 8 and 16; records CTAs per SM 1 (default), 2, 4 at
# batch 256; per-kernel times.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in Q T; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapT
export REPLAYSSM_AOT_DIR=/tmp/aotT REPLAYSSM_GIT_COMMIT=$(cat .commit)
PYTEST_ADDOPTS="-k 'gdn or GDN'" PYTEST_ARGS="--maxfail=5" OUT=$R/tests-gdn timeout 150 bash benchmarks/h200_run.sh tests > $R/tests-gdn.out 2>&1
echo "gdn tests rc=$?"; grep -E "passed|failed|FAILED|Error|Timeout" $R/tests-gdn.out | tail -8 | cut -c1-250
if grep -q " passed" $R/tests-gdn.out && ! grep -q "failed" $R/tests-gdn.out; then
  for t in Q T; do
    cd $D/snap$t
    export REPLAYSSM_AOT_DIR=/tmp/aot$t REPLAYSSM_GIT_COMMIT=$(cat .commit)
    GDN_BENCH_ARGS="--reps 8 --no-fla --batches 1,8,256 --windows 16 --window-sweep 8 --states f32 --shapes qwen4b,qwen122b" \
      OUT=$R/ab-gdn-$t timeout 120 bash benchmarks/h200_run.sh bench-gdn > $R/ab-gdn-$t.out 2>&1
    grep -E "\('qwen" $R/ab-gdn-$t.out | sed "s/^/$t /" | cut -c1-200
  done
  cd $D/snapT; export REPLAYSSM_AOT_DIR=/tmp/aotT REPLAYSSM_GIT_COMMIT=$(cat .commit)
  for n in 2 4; do
    REPLAYSSM_SPLIT_RECORDS_CTAS_PER_SM=$n GDN_BENCH_ARGS="--reps 8 --no-fla --batches 64,256 --windows 16 --states f32 --shapes qwen4b,qwen122b" \
      OUT=$R/ab-gdn-T$n timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/ab-gdn-T$n.out 2>&1
    grep -E "\('qwen" $R/ab-gdn-T$n.out | sed "s/^/T$n /" | cut -c1-200
  done
  source $D/prelude.sh >/dev/null 2>&1
  ( export PYTHONPATH=$PWD:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc
    timeout 90 python3 benchmarks/profile_steps.py --family gdn --shapes qwen4b,qwen122b --out $R/prof > $R/prof.out 2>&1 )
  grep "step" $R/prof.out | cut -c1-200
  PYTEST_ADDOPTS="-k 'not gdn and not GDN'" PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 240 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
  grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
fi
cd $OUT && tar czf run.tgz run && rm -rf run
