#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks, with prebuilt modules (nothing compiles there).
# Prepare here:  ../shared/tools/device-bundle .device
#                python -m replayssm_jit aot --out .device/aot --preset h200
#                (FlashInfer peers) anchor_bench.py --precompile .device/fi_aot, anchors copied into .device/
# On the device: bash benchmarks/h200_run.sh [tests|bench|bench-mamba2|bench-gdn|gdn|verify|peers|all]...
#   tests: every gpu-marked test; bench: both benchmarks; gdn: the GDN GPU tests + bench_gdn;
#   verify: the speculative GPU tests (a process per model) + bench_verify.
#   Extra arguments: PYTEST_ARGS, BENCH_ARGS (bench_mamba2), GDN_BENCH_ARGS (bench_gdn), PEER_ARGS;
#   select tests with PYTEST_ADDOPTS (pytest splits it with shell quoting): PYTEST_ADDOPTS="-k '256 or pad'".
#   Launch choices for a benchmark go in its arguments: BENCH_ARGS="--launch kernel=split,rows_per_cta=16"
#   (a LaunchConfig for every plan()). test_mamba2_gpu.py and test_gdn_gpu.py clear REPLAYSSM_LAUNCH.
set -uo pipefail
what=${*:-all}
DEV=${DEVICE_DIR:-$PWD/.device}   # the carried bundle: prelude, prebuilt modules, peer scripts
source "$DEV/prelude.sh" || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export REPLAYSSM_AOT_DIR=${REPLAYSSM_AOT_DIR:-$DEV/aot} REPLAYSSM_CACHE_DIR=/tmp/replayssm-cache
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1 FLASHINFER_DISABLE_JIT=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# FlashInfer loads prebuilt modules from its package's data/aot folder.
if [ -d "$DEV/fi_aot" ]; then
  for d in "$DEV"/fi_aot/*/; do
    n=$(basename "$d"); mkdir -p /tmp/site/flashinfer/data/aot/$n && cp "$d"/*.so /tmp/site/flashinfer/data/aot/$n/
  done
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
git log -1 --format='commit %H %s' 2>/dev/null
[ -n "${REPLAYSSM_LAUNCH:-}" ] && echo "REPLAYSSM_LAUNCH=$REPLAYSSM_LAUNCH (fills every plan()'s \"auto\" launch fields)"
rc=0
for step in $what; do
  case $step in
    tests|all)
      python3 -m pytest tests -m gpu -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
      rc=$(( rc | ${PIPESTATUS[0]} )) ;;&
    bench|bench-mamba2|all)
      python3 benchmarks/bench_mamba2.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
      rc=$(( rc | ${PIPESTATUS[0]} )) ;;&
    bench|bench-gdn|gdn|all)
      python3 benchmarks/bench_gdn.py --out "$OUT" ${GDN_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-gdn.log" | tail -60
      rc=$(( rc | ${PIPESTATUS[0]} )) ;;&
    gdn)
      python3 -m pytest tests/gdn/test_gdn_gpu.py tests/gdn/test_gdn_peers_gpu.py -m gpu -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} \
        2>&1 | tee "$OUT/pytest-gdn.log" | tail -40
      rc=$(( rc | ${PIPESTATUS[0]} )) ;;&
    verify)
      # Needs the verify-tests and verify-bench presets in REPLAYSSM_AOT_DIR (about 100 s to build there
      # with --jobs 16). One pytest process per model keeps the device busy while the next one stages.
      for m in super120b nano4b qwen4b qwen122b; do
        python3 -m pytest tests/protocol/test_verify_gpu.py -m gpu -q -p no:cacheprovider -k "$m" ${PYTEST_ARGS:-} \
          > "$OUT/pytest-verify-$m.log" 2>&1 &
      done
      wait
      tail -n 3 "$OUT"/pytest-verify-*.log
      grep -q "failed\|error" "$OUT"/pytest-verify-*.log && rc=1
      python3 benchmarks/bench_verify.py --out "$OUT" ${VERIFY_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-verify.log" | tail -60
      rc=$(( rc | ${PIPESTATUS[0]} ))
      # FlashInfer's spec peers (Mamba-2, super120b) in the same device session, where the anchor
      # and its modules were carried: $DEV/anchors/anchor_lp_spec.py and $DEV/fi_spec.
      if [ -f "$DEV/anchors/anchor_lp_spec.py" ]; then
        python3 "$DEV/anchors/anchor_lp_spec.py" --aot-dir "$DEV/fi_spec" --skip lp,tune \
          --spec-batches "${FI_SPEC_BATCHES:-256,64,8,1}" --spec-ts 2,4,8 --out "$OUT/fi-spec" 2>&1 \
          | tee "$OUT/fi-spec.log" | tail -40
        rc=$(( rc | ${PIPESTATUS[0]} ))
      fi ;;&
    peers|all)
      if [ -f "$DEV/anchor_more.py" ]; then
        python3 "$DEV/anchor_more.py" --aot-dir "$DEV/fi_aot" --delay-fallback --out "$OUT/fi" ${PEER_ARGS:-} 2>&1 \
          | tee "$OUT/peers.log" | tail -40
        rc=$(( rc | ${PIPESTATUS[0]} ))
      fi ;;
  esac
done
exit $rc
