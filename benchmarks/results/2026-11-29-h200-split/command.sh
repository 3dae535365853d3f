#!/usr/bin/env bash
# The H200 device calls behind these results, in order (each from a `git archive` snapshot with the
# modules prebuilt here by `python -m replayssm_jit.aot --out .device/aot --preset h200`, packed as aot.tar.xz).

# ---- call M (.device/call_m.sh) ----
# Call M: split kernel: its GPU tests first, launch variants (split vs stream vs per-item), the split
# step's non-flush/flush split at batch 256, then the full GPU suite.
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1 REPLAYSSM_GIT_COMMIT=$(cat ../snap.commit)
R=$OUT/run; mkdir -p $R/var $R/split $R/tests
PYTEST_ARGS="tests/test_mamba2_gpu.py -k split --maxfail=3" OUT=$R/quick timeout 120 bash benchmarks/h200_run.sh tests > $R/quick.out 2>&1
tail -6 $R/quick.out
BENCH_ARGS="--reps 10 --batches none --window-sweep 16 --states f32 --shapes super120b --tiling-sweep super120b:256:16:f32,nano4b:256:16:f32,super120b:8:16:f32,super120b:1:16:f32,nano4b:8:16:f32,nano4b:1:16:f32,super120b:256:16:bf16,super120b:64:16:f32" \
  OUT=$R/var timeout 200 bash benchmarks/h200_run.sh bench-mamba2 > $R/var.out 2>&1
grep -E "\('(super|nano)" $R/var.out | cut -c1-400
REPLAYSSM_REPLAY_KERNEL=split BENCH_ARGS="--reps 10 --batches 256 --windows 16 --window-sweep 4,32 --states f32 --shapes super120b,nano4b" \
  OUT=$R/split timeout 90 bash benchmarks/h200_run.sh bench-mamba2 > $R/split.out 2>&1
grep -E "\('(super|nano)" $R/split.out | cut -c1-300
PYTEST_ARGS="--maxfail=5 --durations=3" OUT=$R/tests timeout 240 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -8 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run

# ---- call N (.device/call_n.sh) ----
# Call N: split kernels for both families: their GPU tests, launch variants, then the full GPU suite.
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1 REPLAYSSM_GIT_COMMIT=$(cat ../snap.commit) REPLAYSSM_AOT_DIR=/tmp/aot
[ -d /tmp/aot ] && [ "$(cat /tmp/aot.commit 2>/dev/null)" = "$(cat ../snap.commit)" ] || { rm -rf /tmp/aot && tar xJf ../aot.tar.xz -C /tmp && cat ../snap.commit > /tmp/aot.commit; }
R=$OUT/run; mkdir -p $R/var $R/gvar $R/tests $R/quick
PYTEST_ARGS="tests/test_mamba2_gpu.py tests/test_gdn_gpu.py -k split_ --maxfail=3" OUT=$R/quick timeout 150 bash benchmarks/h200_run.sh tests > $R/quick.out 2>&1
tail -4 $R/quick.out
BENCH_ARGS="--reps 10 --batches none --window-sweep 16 --states f32 --shapes super120b --tiling-sweep super120b:256:16:f32,nano4b:256:16:f32,super120b:8:16:f32,super120b:1:16:f32,nano4b:1:16:f32,super120b:256:16:bf16" \
  OUT=$R/var timeout 130 bash benchmarks/h200_run.sh bench-mamba2 > $R/var.out 2>&1
grep -E "\('(super|nano)" $R/var.out | tr ' ' '\n' | grep -E "split|flush1|rows..=|rows.=|\('" | paste -sd' ' | sed 's/(/\n(/g' | cut -c1-300
GDN_BENCH_ARGS="--reps 10 --no-fla --batches none --window-sweep 16 --states f32 --shapes qwen4b --tiling-sweep qwen4b:256:16:f32,qwen122b:256:16:f32,qwen4b:8:16:f32,qwen4b:1:16:f32,qwen122b:1:16:f32,qwen4b:256:16:bf16" \
  OUT=$R/gvar timeout 120 bash benchmarks/h200_run.sh bench-gdn > $R/gvar.out 2>&1
grep -E "\('qwen" $R/gvar.out | tr ' ' '\n' | grep -E "split|flush1|rows..=|rows...=|\('" | paste -sd' ' | sed 's/(/\n(/g' | cut -c1-300
PYTEST_ARGS="--maxfail=5 --durations=3" OUT=$R/tests timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -6 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run

# ---- call P (.device/call_p.sh) ----
# Call P: split kernels v3: their GPU tests, launch variants at batch 256, then the full GPU suite.
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1 REPLAYSSM_GIT_COMMIT=$(cat ../snap.commit) REPLAYSSM_AOT_DIR=/tmp/aot
[ -d /tmp/aot ] && [ "$(cat /tmp/aot.commit 2>/dev/null)" = "$(cat ../snap.commit)" ] || { rm -rf /tmp/aot && tar xJf ../aot.tar.xz -C /tmp && cat ../snap.commit > /tmp/aot.commit; }
R=$OUT/run; mkdir -p $R/var $R/gvar $R/tests $R/quick
PYTEST_ARGS="tests/test_mamba2_gpu.py tests/test_gdn_gpu.py -k split_ --maxfail=3" OUT=$R/quick timeout 150 bash benchmarks/h200_run.sh tests > $R/quick.out 2>&1
tail -3 $R/quick.out
BENCH_ARGS="--reps 10 --batches none --window-sweep 16 --states f32 --shapes super120b --tiling-sweep super120b:256:16:f32,nano4b:256:16:f32,super120b:256:16:bf16" \
  OUT=$R/var timeout 100 bash benchmarks/h200_run.sh bench-mamba2 > $R/var.out 2>&1
grep -E "\('(super|nano)" $R/var.out | tr ' ' '\n' | grep -E "split|@rows64=|@rows80=|@rows40=|\('" | paste -sd' ' | sed 's/(/\n(/g' | cut -c1-300
GDN_BENCH_ARGS="--reps 10 --no-fla --batches none --window-sweep 16 --states f32 --shapes qwen4b --tiling-sweep qwen4b:256:16:f32,qwen122b:256:16:f32" \
  OUT=$R/gvar timeout 80 bash benchmarks/h200_run.sh bench-gdn > $R/gvar.out 2>&1
grep -E "\('qwen" $R/gvar.out | tr ' ' '\n' | grep -E "split|@rows64=|@rows128=|\('" | paste -sd' ' | sed 's/(/\n(/g' | cut -c1-300
PYTEST_ARGS="--maxfail=5 --durations=3" OUT=$R/tests timeout 280 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -6 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run

# ---- call O (.device/call_o.sh) ----
# Call O: final side-by-side benchmarks: Mamba-2 with FlashInfer's peers, GDN with fla (benchmark modules only).
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1 REPLAYSSM_GIT_COMMIT=$(cat ../snap.commit) REPLAYSSM_AOT_DIR=/tmp/aot
[ -d /tmp/aot ] && [ "$(cat /tmp/aot.commit 2>/dev/null)" = "$(cat ../snap.commit)" ] || { rm -rf /tmp/aot && tar xJf ../aot.tar.xz -C /tmp && cat ../snap.commit > /tmp/aot.commit; }
R=$OUT/run; mkdir -p $R/m2 $R/gdn $R/fi
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 160 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "amortized|selective_state_update\[|autotune pass" $R/peers.out | tail -24 | cut -c1-200
BENCH_ARGS="--reps 10 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 200 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "copy|\('(super|nano)" $R/m2.out | cut -c1-220
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 200 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen" $R/gdn.out | cut -c1-220
cd $OUT && tar czf run.tgz run && rm -rf run

# ---- call Q (.device/call_q.sh) ----
# Call Q: split kernels v4 (small state-kernel shared memory): split tests, batch 256 variants,
# the default step at batch 1/8/256, then the full GPU suite.
cd "$(dirname "$0")/snap" || exit 1
export DEVICE_DIR=$PWD/.. PYTHONUNBUFFERED=1 REPLAYSSM_GIT_COMMIT=$(cat ../snap.commit) REPLAYSSM_AOT_DIR=/tmp/aot
[ -d /tmp/aot ] && [ "$(cat /tmp/aot.commit 2>/dev/null)" = "$(cat ../snap.commit)" ] || { rm -rf /tmp/aot && tar xJf ../aot.tar.xz -C /tmp && cat ../snap.commit > /tmp/aot.commit; }
R=$OUT/run; mkdir -p $R/var $R/gvar $R/tests $R/quick $R/m2 $R/gdn
PYTEST_ARGS="tests/test_mamba2_gpu.py tests/test_gdn_gpu.py -k split_ --maxfail=3" OUT=$R/quick timeout 100 bash benchmarks/h200_run.sh tests > $R/quick.out 2>&1
tail -2 $R/quick.out
BENCH_ARGS="--reps 10 --batches 1,8,256 --windows 16 --window-sweep 16 --states f32,bf16 --shapes super120b,nano4b --tiling-sweep super120b:256:16:f32" \
  OUT=$R/m2 timeout 100 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)" $R/m2.out | cut -c1-200
GDN_BENCH_ARGS="--reps 10 --no-fla --batches 1,8,256 --windows 16 --window-sweep 16 --states f32,bf16 --shapes qwen4b,qwen122b --tiling-sweep qwen4b:256:16:f32" \
  OUT=$R/gdn timeout 100 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen" $R/gdn.out | cut -c1-200
PYTEST_ARGS="--maxfail=5 --durations=3" OUT=$R/tests timeout 260 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -4 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run
