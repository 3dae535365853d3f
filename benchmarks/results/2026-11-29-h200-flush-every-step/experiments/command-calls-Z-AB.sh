#!/usr/bin/env bash
# Call Z: per-row hand-over (wip/row-handover): split and records-loop tests, then records CTAs
# per SM 0/1/2 side by side at batch 8 and 256 (L = 16, FP32), then split forced at batch 1.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapZ
export PYTHONUNBUFFERED=1
rm -rf /tmp/aotZ && mkdir -p /tmp/aotZ && tar xJf $D/aotZ.tar.xz -C /tmp/aotZ --strip-components=1
R=$OUT/run; mkdir -p $R
run() {  # run NAME TIMEOUT what [ENV=...]
  n=$1; t=$2; w=$3; shift 3
  (cd $S && env "$@" DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotZ REPLAYSSM_GIT_COMMIT=$(cat $S/.commit) OUT=$R/$n \
     timeout $t bash benchmarks/h200_run.sh $w > $R/$n.out 2>&1)
  grep -E "\('(super|nano|qwen)" $R/$n.out | sed "s/^/$n /" | cut -c1-300
}
run tests 170 tests PYTEST_ARGS="tests/test_mamba2_gpu.py tests/test_gdn_gpu.py -k split_ --maxfail=3 --durations=5"
tail -3 $R/tests.out
M="--reps 8 --batches 8 --windows 16 --window-sweep 16 --states f32 --shapes super120b,nano4b"
G="--reps 8 --no-fla --batches 8 --windows 16 --window-sweep 16 --states f32 --shapes qwen4b,qwen122b"
for k in 0 1 2; do
  run m2-k$k 60 bench-mamba2 BENCH_ARGS="$M" REPLAYSSM_SPLIT_RECORDS_CTAS_PER_SM=$k
  run gdn-k$k 60 bench-gdn GDN_BENCH_ARGS="$G" REPLAYSSM_SPLIT_RECORDS_CTAS_PER_SM=$k
done
run m2-b1split 40 bench-mamba2 BENCH_ARGS="--reps 8 --batches 1 --windows 16 --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes super120b,nano4b" REPLAYSSM_REPLAY_KERNEL=split
run gdn-b1split 40 bench-gdn GDN_BENCH_ARGS="--reps 8 --no-fla --batches 1 --windows 16 --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes qwen4b,qwen122b" REPLAYSSM_REPLAY_KERNEL=split
cd $OUT && tar czf run.tgz run && rm -rf run
#!/usr/bin/env bash
# Call AB: N (records-instructions merged + flush-every-step at small batch) against E (N + the
# split state kernels' checkpoint loads evict-first in L2), side by side: batch 1, 8, 256 at
# L = 16 (FP32 checkpoints), then per-kernel profiles at batch 256.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for v in N E; do rm -rf /tmp/aot$v && mkdir -p /tmp/aot$v && tar xJf $D/aot$v.tar.xz -C /tmp/aot$v --strip-components=1; done
R=$OUT/run; mkdir -p $R
run() {  # run VARIANT NAME TIMEOUT what [ENV=...]
  v=$1; n=$2; t=$3; w=$4; shift 4; s=$D/snap$v
  (cd $s && env "$@" DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aot$v REPLAYSSM_GIT_COMMIT=$(cat $s/.commit) OUT=$R/$v-$n \
     timeout $t bash benchmarks/h200_run.sh $w > $R/$v-$n.out 2>&1)
  grep -E "\('(super|nano|qwen)|passed|failed|Error" $R/$v-$n.out | sed "s/^/$v-$n /" | cut -c1-330
}
M="--reps 8 --batches 1,8 --windows 16 --window-sweep 16 --states f32 --shapes super120b,nano4b"
G="--reps 8 --no-fla --batches 1,8 --windows 16 --window-sweep 16 --states f32 --shapes qwen4b,qwen122b"
for v in N E; do run $v m2 75 bench-mamba2 BENCH_ARGS="$M"; run $v gdn 75 bench-gdn GDN_BENCH_ARGS="$G"; done
run N m2b1pi 40 bench-mamba2 BENCH_ARGS="--reps 8 --batches 1 --windows 16 --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes super120b,nano4b" REPLAYSSM_REPLAY_KERNEL=per-item
run N gdnb1pi 40 bench-gdn GDN_BENCH_ARGS="--reps 8 --no-fla --batches 1 --windows 16 --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes qwen4b,qwen122b" REPLAYSSM_REPLAY_KERNEL=per-item
source $D/prelude.sh >/dev/null 2>&1
for v in N E; do
  s=$D/snap$v
  for f in mamba2:super120b,nano4b gdn:qwen4b,qwen122b; do
    (cd $s && PYTHONPATH=$s:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=/tmp/aot$v \
      timeout 60 python3 benchmarks/profile_steps.py --family ${f%%:*} --shapes ${f#*:} --out $R/$v-prof 2>&1 | grep -E "step|Error" | sed "s/^/$v /" | cut -c1-250)
  done
done
cd $OUT && tar czf run.tgz run && rm -rf run
