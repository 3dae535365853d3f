#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, initcheck and synccheck over every kernel choice of every
# family, verify, commit and snapshot kernels included (scripts/sanitize_kernels.py), in one device
# call of about 9 minutes, with prebuilt modules.
# Prepare here (line information in the modules, so that reports name source lines; the device side
# uses the same REPLAYSSM_JIT_DEBUG, which enters the modules' digests):
#   ../shared/tools/device-bundle .device
#   REPLAYSSM_JIT_DEBUG=1 python -m replayssm_jit aot --out .device/aot-sanitizer --presets-from tests/support/aot_presets.py --preset sanitizer
#   REPLAYSSM_JIT_DEBUG=1 REPLAYSSM_AOT_DIR=.device/aot-sanitizer python scripts/sanitize_kernels.py --check-preset
# On the device: bash scripts/sanitize.sh [memcheck|racecheck|initcheck|synccheck|plain]...
#   (default: the four tools in that order; plain: the script without a sanitizer)
#   Logs: $OUT/sanitizer-<tool>.log; at the end one line per tool: exit code, the tool's summary
#   line, the script's count of configs (a run stops starting configs 30 s before its limit, so
#   that the tool still prints its summary; configs it did not reach count as "not run").
#   Script arguments per tool: MEMCHECK_ARGS, RACECHECK_ARGS, INITCHECK_ARGS, SYNCCHECK_ARGS,
#   PLAIN_ARGS (replace the defaults below). Limits in seconds: MEMCHECK_LIMIT, RACECHECK_LIMIT,
#   INITCHECK_LIMIT, SYNCCHECK_LIMIT, PLAIN_LIMIT. More compute-sanitizer options for every tool:
#   SANITIZER_ARGS. SANITIZE_OPS: the steps to check (default: all; e.g. "verify snapshot").
#   INITCHECK_SPACE: global, shared or all (compute-sanitizer 2025.4+; default: the tool's). KERNEL_FILTER: the
#   --kernel-name filter (default kns=_kernel, the substring of our two __global__ functions:
#   per_item_kernel, which every step, verify and snapshot kernel instantiates, and commit_kernel;
#   empty: check every kernel, the script launches no PyTorch kernel).
set -uo pipefail
tools=${*:-memcheck racecheck initcheck synccheck}
DEV=${DEVICE_DIR:-$PWD/.device}
source "$DEV/prelude.sh" || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export REPLAYSSM_AOT_DIR=${REPLAYSSM_AOT_DIR:-$DEV/aot-sanitizer} REPLAYSSM_CACHE_DIR=/tmp/replayssm-cache
export REPLAYSSM_DISABLE_JIT=1 REPLAYSSM_JIT_DEBUG=${REPLAYSSM_JIT_DEBUG:-1}
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1 CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-LAZY}
unset REPLAYSSM_LAUNCH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
if ! command -v "$SAN" >/dev/null; then  # the toolkit's copy where it is not on PATH
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [ -x "$c" ] && SAN=$c && break
  done
fi
SCRIPT=scripts/sanitize_kernels.py
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log -1 --format='commit %H %s' 2>/dev/null
if [ "$tools" != plain ]; then
  command -v "$SAN" >/dev/null || { echo "$SAN not found (set COMPUTE_SANITIZER)"; exit 2; }
  "$SAN" --version | tail -1
fi

# SANITIZE_OPS (e.g. "verify snapshot"): only those steps' configs, in the preflight and every tool.
ops=()
[ -n "${SANITIZE_OPS:-}" ] && read -ra ops <<< "--ops $SANITIZE_OPS"
# Preflight without a sanitizer: every module loads and plans as each config asks (no steps).
if ! python3 "$SCRIPT" --steps 0 "${ops[@]}" > "$OUT/sanitizer-preflight.log" 2>&1; then
  tail -20 "$OUT/sanitizer-preflight.log"
  echo "preflight failed (log: $OUT/sanitizer-preflight.log): no tool run"
  exit 2
fi
tail -1 "$OUT/sanitizer-preflight.log"

filter=()
KERNEL_FILTER=${KERNEL_FILTER-kns=_kernel}
[ -n "$KERNEL_FILTER" ] && filter=(--kernel-name "$KERNEL_FILTER")
summaries=()
rc=0
for tool in $tools; do
  env_vars=()
  case $tool in
    memcheck)
      limit=${MEMCHECK_LIMIT:-150}; args=${MEMCHECK_ARGS:---outputs nan}
      # Each tensor its own cudaMalloc, so that an access past its end leaves the allocation.
      env_vars=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
      # No leak check: tensors alive at interpreter exit are PyTorch's, and reporting them outlasts the limit.
      opts=(--padding 65536 --report-api-errors explicit) ;;
    racecheck)
      limit=${RACECHECK_LIMIT:-150}; args=${RACECHECK_ARGS:---quick --outputs nan}
      opts=(--racecheck-report analysis) ;;
    initcheck)
      limit=${INITCHECK_LIMIT:-120}; args=${INITCHECK_ARGS:---outputs empty --empty-rings}
      # Fresh allocations: memory an earlier config wrote must not count as initialised.
      env_vars=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
      opts=(); [ -n "${INITCHECK_SPACE:-}" ] && opts=(--initcheck-address-space "$INITCHECK_SPACE") ;;  # newer tools only
    synccheck)
      limit=${SYNCCHECK_LIMIT:-90}; args=${SYNCCHECK_ARGS:---outputs nan}
      opts=() ;;
    plain)
      limit=${PLAIN_LIMIT:-90}; args=${PLAIN_ARGS:---outputs nan} ;;
    *) echo "unknown tool $tool (memcheck, racecheck, initcheck, synccheck, plain)"; rc=2; continue ;;
  esac
  log=$OUT/sanitizer-$tool.log
  budget=$(( limit > 60 ? limit - 30 : limit / 2 ))
  # shellcheck disable=SC2086  # the script's arguments split on spaces
  if [ "$tool" = plain ]; then
    cmd=(python3 "$SCRIPT" --time-budget "$budget" "${ops[@]}" $args)
  else
    cmd=("$SAN" --tool "$tool" --error-exitcode 1 "${opts[@]}" "${filter[@]}" ${SANITIZER_ARGS:-}
         python3 "$SCRIPT" --time-budget "$budget" "${ops[@]}" $args)
  fi
  echo "== $tool (limit $limit s): ${cmd[*]}"
  started=$SECONDS
  env "${env_vars[@]}" timeout -k 15 "$limit" "${cmd[@]}" > "$log" 2>&1
  code=$?
  rc=$(( rc | (code != 0) ))
  tail -3 "$log"
  summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^=* *//')
  [ -z "$summary" ] && summary="no summary ($([ "$tool" = plain ] && echo "no sanitizer" || echo "killed at its limit or failed to start"))"
  counted=$(grep '^sanitize_kernels:' "$log" | tail -1)
  summaries+=("$(printf '%-9s rc=%-3s %4ss  %s | %s' "$tool" "$code" $(( SECONDS - started )) "$summary" "${counted:-no config count}")")
  if grep -qiE 'device not supported|Unable to find any supported device' "$log"; then
    echo "compute-sanitizer does not support this machine's device (a gVisor runtime?): stopping"
    break
  fi
done
echo "== summary (logs in $OUT)"
printf '%s\n' "${summaries[@]}"
exit $rc
