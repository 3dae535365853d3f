#!/usr/bin/env bash
# Call D: GDN benchmark (fla side by side), FlashInfer Mamba-2 peers, and our Mamba-2 at the same shapes.
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1
R=$OUT/run; mkdir -p $R
PYTEST_ARGS="-k 256 --durations=3" OUT=$R timeout 90 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -4 $R/tests.out
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --tiling-sweep qwen4b:256:16:f32,qwen122b:256:16:f32,qwen4b:8:16:f32" \
  OUT=$R timeout 150 bash benchmarks/h200_run.sh bench-gdn > $R/bench-gdn.out 2>&1
grep -E "copy|\('qwen" $R/bench-gdn.out | cut -c1-300
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 150 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "amortized|selective_state_update\[|autotune pass" $R/peers.out | tail -24 | cut -c1-200
mkdir -p $R/m2
BENCH_ARGS="${MAMBA2_ARGS:---batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --tiling-sweep super120b:256:16:f32,nano4b:256:16:f32,super120b:1:16:f32,super120b:8:16:f32 --shapes super120b,nano4b}" \
  OUT=$R/m2 timeout 170 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2/out 2>&1
grep -E "\('(super|nano)" $R/m2/out | cut -c1-250
cd $OUT && tar czf run.tgz run && rm -rf run
