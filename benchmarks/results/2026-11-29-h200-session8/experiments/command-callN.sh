#!/usr/bin/env bash
# Call N (prepared for the next session): two GDN branches, each built here for sm_90a:
#   N  wip/gdn-flush-only-float-k (snapN, aotN, 2cdaeb6): the split state kernel converts k, q, v
#      to FP32 once per CTA on flush steps only (call K converted on every step: flush faster,
#      batch 8 slower);
#   D  wip/gdn-dots-hoist (snapD, aotD, e0c0e48): the records kernel reads a lane's k_j and q
#      values once, not once per record.
# Full GPU suite on each, then a GDN A/B against main (snapF/aotW = main 0acdba8's kernels; later
# main commits are results only) at batch 8 and 256, L = 8 and 16, FP32 and BF16 checkpoints.
# Merge a branch if its suite passes and batch 256 is faster with batch 8 level (main, call K:
# qwen4b 164.5 / 9.9 us, qwen122b 313.5 / 17.5; flush 339.3 and 644.9).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for t in W N D; do [ -d /tmp/aot$t ] || { mkdir -p /tmp/aot$t && tar xJf $D/aot$t.tar.xz -C /tmp/aot$t --strip-components=1; }; done
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
for t in N D; do
  cd $D/snap$t
  export REPLAYSSM_AOT_DIR=/tmp/aot$t REPLAYSSM_GIT_COMMIT=$(cat .commit)
  PYTEST_ARGS="--maxfail=10 --durations=3" OUT=$R/tests-$t timeout 200 bash benchmarks/h200_run.sh tests > $R/tests-$t.out 2>&1
  grep -E "passed|failed|FAILED|Error" $R/tests-$t.out | tail -6 | sed "s/^/$t /" | cut -c1-250
done
for t in F N D; do
  cd $D/snap$t; a=$t; [ $t = F ] && a=W
  export REPLAYSSM_AOT_DIR=/tmp/aot$a REPLAYSSM_GIT_COMMIT=$(cat .commit)
  GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,256 --windows 16 --window-sweep 8 --states f32,bf16 --shapes qwen4b,qwen122b" \
    OUT=$R/ab-gdn-$t timeout 80 bash benchmarks/h200_run.sh bench-gdn > $R/ab-gdn-$t.out 2>&1
  grep -E "\('qwen" $R/ab-gdn-$t.out | sed "s/^/$t /" | cut -c1-200
done
cd $OUT && tar czf run.tgz run && rm -rf run
