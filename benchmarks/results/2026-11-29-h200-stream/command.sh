#!/usr/bin/env bash
# The three device calls behind these results, in order (each run from .device/ with the repository snapshot in
# .device/snap and prebuilt modules in .device/aot; see README.md here).

### call H (kernels of 1619ea0): smoke, quick benchmarks, full GPU suite -> pytest-gpu-full.log, experiments/stream_v4_*
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1 REPLAYSSM_GIT_COMMIT=1619ea0ccc2c6ec596b4e3c7feb0d883509ed7b7
R=$OUT/run; mkdir -p $R
PYTEST_ARGS="-k stream_tile --durations=3" OUT=$R/smoke timeout 100 bash benchmarks/h200_run.sh tests > $R/smoke.out 2>&1
rc=$?; tail -4 $R/smoke.out
if [ $rc -eq 124 ]; then echo "SMOKE TIMED OUT"; cd $OUT && tar czf run.tgz run; exit 1; fi
BENCH_ARGS="--reps 8 --batches none --window-sweep 16 --states f32 --tiling-sweep super120b:256:16:f32,nano4b:256:16:f32,super120b:1:16:f32,super120b:8:16:f32 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 100 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "copy|\('(super|nano)" $R/m2.out | cut -c1-700
GDN_BENCH_ARGS="--reps 8 --no-fla --batches none --window-sweep 16 --states f32 --tiling-sweep qwen4b:256:16:f32,qwen122b:256:16:f32,qwen4b:1:16:f32,qwen4b:8:16:f32 --shapes qwen4b,qwen122b" \
  OUT=$R/gdn timeout 80 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "copy|\('qwen" $R/gdn.out | cut -c1-700
PYTEST_ARGS="--maxfail=8 --durations=5" OUT=$R timeout 280 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -12 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run

### call I (9d5c0a3, final launch heuristics; 40 benchmark modules plus FlashInfer) -> mamba2.json, gdn.json, flashinfer_peers.json
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1 REPLAYSSM_GIT_COMMIT=9d5c0a3ee281c036c8f46791ca8aa8adc9c78432
R=$OUT/run; mkdir -p $R
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --tiling-sweep qwen4b:256:16:f32,qwen122b:256:16:f32" \
  OUT=$R timeout 170 bash benchmarks/h200_run.sh bench-gdn > $R/bench-gdn.out 2>&1
grep -E "copy|\('qwen" $R/bench-gdn.out | cut -c1-260
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 150 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "amortized|selective_state_update\[|autotune pass" $R/peers.out | tail -24 | cut -c1-200
mkdir -p $R/m2
BENCH_ARGS="--reps 10 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --tiling-sweep super120b:256:16:f32,nano4b:256:16:f32,super120b:1:16:f32,super120b:8:16:f32 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 210 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2/out 2>&1
grep -E "\('(super|nano)" $R/m2/out | cut -c1-260
cd $OUT && tar czf run.tgz run && rm -rf run

### call J (9d5c0a3): GPU tests that run with the launch defaults -> pytest-gpu-final-defaults.log
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1
R=$OUT/run; mkdir -p $R
PYTEST_ARGS="--durations=5" PYTEST_ADDOPTS="-k 'not replay_fp32_matches_reference and not every_row_tiling and not conventional_fp32_matches'" OUT=$R timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -14 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run

### call K (5ed93fc, kernels as in 1619ea0): launch variants with bf16 checkpoints -> bf16_launch_variants_*.json
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1 REPLAYSSM_GIT_COMMIT=5ed93fc290352e99de39860551bcf84846bf376e
R=$OUT/run; mkdir -p $R/m2 $R/gdn
BENCH_ARGS="--reps 8 --batches none --window-sweep 16 --states bf16 --shapes super120b,nano4b --tiling-sweep super120b:256:16:bf16,nano4b:256:16:bf16,super120b:8:16:bf16" \
  OUT=$R/m2 timeout 100 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)" $R/m2.out | cut -c1-600
GDN_BENCH_ARGS="--reps 8 --no-fla --batches none --window-sweep 16 --states bf16 --shapes qwen4b --tiling-sweep qwen4b:256:16:bf16" \
  OUT=$R/gdn timeout 60 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen" $R/gdn.out | cut -c1-600
cd $OUT && tar czf run.tgz run && rm -rf run

### call J2 (870282a): the same tests on the final heuristics -> pytest-gpu-final-defaults-870282a.log
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1
R=$OUT/run; mkdir -p $R
PYTEST_ARGS="--durations=5" PYTEST_ADDOPTS="-k 'not replay_fp32_matches_reference and not every_row_tiling and not conventional_fp32_matches'" OUT=$R timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -14 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run

### call L (0e13ef6, review refactor of launchers, streaming driver and launch choice): full GPU suite -> pytest-gpu-full-0e13ef6.log
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1
R=$OUT/run; mkdir -p $R
PYTEST_ARGS="--maxfail=5 --durations=3" OUT=$R timeout 250 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -8 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run
