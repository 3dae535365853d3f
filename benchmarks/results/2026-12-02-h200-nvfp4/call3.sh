#!/usr/bin/env bash
# Call 3: formats benchmark (super120b, batch 256, L = 16) and FlashInfer's checkpointing_ssu fp16/bf16/fp8 in one run;
# then compute-sanitizer memcheck and racecheck over the NVFP4 decode configs.
set -uo pipefail
source .device/prelude.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 REPLAYSSM_CACHE_DIR=/tmp/replayssm-cache
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
unset REPLAYSSM_LAUNCH
R=/tmp/res; mkdir -p $R
echo "commit $(cat .device/commit.txt)" > $R/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >> $R/env.txt
t0=$(date +%s)
( REPLAYSSM_JIT_DEBUG=1 python3 -c "
from pathlib import Path
from replayssm_jit.jit.aot import preset_specs, build_aot
build_aot([s for s in preset_specs(['sanitizer']) if 'nvfp4' in s.uri], Path('/tmp/aot-san'), 6, ['9.0a'])" > $R/build-san.log 2>&1 ) &
python3 .device/build_specs.py .device/specs-call3.pkl /tmp/aot 10 > $R/build.log 2>&1; echo "build rc=$? $(( $(date +%s) - t0 )) s" | tee -a $R/build.log
wait; echo "both builds $(( $(date +%s) - t0 )) s" >> $R/build.log
export REPLAYSSM_AOT_DIR=/tmp/aot REPLAYSSM_DISABLE_JIT=1
timeout ${BENCH_LIMIT:-190} python3 benchmarks/bench_mamba2.py --shapes super120b --batches 256 --windows 16 --window-sweep 16 \
  --states ${STATES:-f32,bf16,e4m3,f32+e4m3,nvfp4,nvfp4sr,f32+nvfp4,f32+nvfp4sr} --out $R/bench > $R/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - t0 )) s" >> $R/bench.log
FLASHINFER_DISABLE_JIT=1 timeout ${FI_LIMIT:-150} python3 .device/anchors/anchor_lp_spec.py --aot-dir .device/fiaot --skip spec --batches 256 --out $R/fi > $R/fi.log 2>&1; echo "fi rc=$? $(( $(date +%s) - t0 )) s" >> $R/fi.log
export REPLAYSSM_AOT_DIR=/tmp/aot-san REPLAYSSM_JIT_DEBUG=1
FMTS="--families mamba2 --formats nvfp4,nvfp4+sr,f32+nvfp4,f32+nvfp4+sr --outputs nan"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 95 compute-sanitizer --tool memcheck --kernel-name kns=_kernel --padding 65536 --report-api-errors explicit \
  python3 scripts/sanitize_kernels.py $FMTS --time-budget 65 > $R/memcheck.log 2>&1; echo "memcheck rc=$?" >> $R/memcheck.log
timeout 95 compute-sanitizer --tool racecheck --kernel-name kns=_kernel --racecheck-report analysis \
  python3 scripts/sanitize_kernels.py $FMTS --time-budget 65 > $R/racecheck.log 2>&1; echo "racecheck rc=$?" >> $R/racecheck.log
for f in $R/*.log; do echo "== $f"; tail -n 14 $f; done
cd /tmp && tar czf $OUT/res.tgz res
