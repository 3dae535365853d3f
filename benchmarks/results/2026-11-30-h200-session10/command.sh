#!/usr/bin/env bash
# The two device calls behind this record, on main's kernels (74f2439):
#   bash command.sh D   call D: the full GPU suite; FlashInfer's Mamba-2 peers (selective_state_update
#                       at batch 1 and 8; it and checkpointing_ssu, default and autotuned, at 64 and
#                       256); the GDN sweep with fla; our Mamba-2 sweep -> gdn.json, mamba2.json,
#                       flashinfer_peers.json (tables.md and the plots: benchmarks/report.py)
#   bash command.sh E   call E: the window sweep L = 4, 8, 16, 32 at batch 256, FP32 and BF16
#                       checkpoints, both families (fla does not depend on L) -> window-sweep-*.json
# Beside this script on the device: snapB/ (`git archive` of the commit, its hash in snapB/.commit)
# and aotB.tar.xz (modules prebuilt here for sm_90a by `python -m replayssm_jit.aot`).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 DEVICE_DIR=$D
[ -d /tmp/aotB ] || { mkdir -p /tmp/aotB && tar xJf "$D/aotB.tar.xz" -C /tmp/aotB --strip-components=1; }
cd "$D/snapB" || exit 1
export REPLAYSSM_AOT_DIR=/tmp/aotB REPLAYSSM_GIT_COMMIT=$(cat .commit)

# step NAME SECONDS TARGET [VAR=VALUE ...]: one h200_run.sh target, its output under $OUT/NAME, tarred
step() {
  local name=$1 limit=$2 target=$3; shift 3
  mkdir -p "$OUT/$name"
  env "$@" OUT="$OUT/$name" timeout "$limit" bash benchmarks/h200_run.sh "$target" > "$OUT/$name.out" 2>&1
  (cd "$OUT" && tar czf "$name.tgz" "$name" "$name.out" && rm -rf "$name")
}

call_d() {
  step tests 240 tests PYTEST_ARGS="--maxfail=10 --durations=5"
  export REPLAYSSM_DISABLE_JIT=1
  step peers 140 peers PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy"
  step gdn 160 bench-gdn GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 8 --states f32,bf16"
  step m2 140 bench-mamba2 BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 8 --states f32,bf16 --shapes super120b,nano4b"
}

call_e() {
  export REPLAYSSM_DISABLE_JIT=1
  step lsweep-gdn 200 bench-gdn GDN_BENCH_ARGS="--reps 8 --no-fla --shapes qwen4b,qwen122b --batches none --window-sweep 4,8,16,32 --states f32,bf16"
  step lsweep-m2 200 bench-mamba2 BENCH_ARGS="--reps 8 --shapes super120b,nano4b --batches none --window-sweep 4,8,16,32 --states f32,bf16"
}

case ${1:-D} in
  D) call_d ;;
  E) call_e ;;
  *) echo "usage: bash command.sh D|E" >&2; exit 2 ;;
esac
