#!/usr/bin/env bash
# The device call behind this record, from the repository root on the H200:
#   bash benchmarks/results/2026-12-01-h200-architecture/command.sh
# Carried beside the tree: .device/ (device-bundle's packages, FlashInfer's prebuilt
# selective_state_update in fi_aot/, aot.tar.xz = `python -m replayssm_jit aot --preset h200`
# built for sm_90a on a CPU machine, and commit = the commit those were built from).
# Output under $OUT: the GPU suite's log, the two benchmarks' JSON and logs.
set -uo pipefail
export PYTHONUNBUFFERED=1 DEVICE_DIR=$PWD/.device REPLAYSSM_GIT_COMMIT=$(cat .device/commit)
mkdir -p /tmp/aot && tar xJf .device/aot.tar.xz -C /tmp/aot --strip-components=1
export REPLAYSSM_AOT_DIR=/tmp/aot
step() {  # step NAME SECONDS TARGET [VAR=VALUE ...]: one h200_run.sh target, output in $OUT/NAME*
  local name=$1 limit=$2 target=$3; shift 3
  mkdir -p "$OUT/$name"
  env "$@" OUT="$OUT/$name" timeout "$limit" bash benchmarks/h200_run.sh "$target" > "$OUT/$name.out" 2>&1
  echo "$name: rc=$?"; tail -4 "$OUT/$name.out"
  (cd "$OUT" && tar czf "$name.tgz" "$name" "$name.out" && rm -rf "$name")
}
# The suite may JIT what the h200 preset lacks (one L = 2 module); the benchmarks load only AOT.
step tests 270 tests PYTEST_ARGS="--maxfail=20 --durations=5"
export REPLAYSSM_DISABLE_JIT=1
[ -n "${SKIP_BENCH:-}" ] && exit 0
[ -n "${SKIP_GDN:-}" ] || step gdn 150 bench-gdn GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,256 --windows 16 --states f32,bf16"
step m2 150 bench-mamba2 BENCH_ARGS="--reps 8 --shapes super120b,nano4b --batches 1,8,256 --windows 16 --states f32,bf16"
