#!/usr/bin/env bash
# Call 4: GDN separate mode on the H200: formats GPU tests, accuracy study (GDN), speed at qwen122b, sanitizer.
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
build_aot([s for s in preset_specs(['sanitizer']) if s.family == 'gdn' and s.read_dtype], Path('/tmp/aot-san'), 4, ['9.0a'])" > $R/build-san.log 2>&1 ) &
python3 .device/build_specs.py .device/specs-call4.pkl /tmp/aot 12 > $R/build.log 2>&1; echo "build rc=$? $(( $(date +%s) - t0 )) s" | tee -a $R/build.log
wait; echo "both builds $(( $(date +%s) - t0 )) s" >> $R/build.log
export REPLAYSSM_AOT_DIR=/tmp/aot
( timeout 200 python3 -m pytest tests/test_checkpoint_formats.py -m gpu -q -rs -p no:cacheprovider > $R/formats.log 2>&1; echo "rc=$? $(( $(date +%s) - t0 )) s" >> $R/formats.log ) &
( timeout 200 python3 benchmarks/accuracy_kernels.py --family gdn --device cuda --out $R/acc > $R/acc.log 2>&1; echo "rc=$? $(( $(date +%s) - t0 )) s" >> $R/acc.log ) &
wait
export REPLAYSSM_DISABLE_JIT=1
timeout ${BENCH_LIMIT:-150} python3 benchmarks/bench_gdn.py --shapes qwen122b --batches 256,8,1 --windows 16 --window-sweep 16 --no-fla \
  --states ${STATES:-f32,bf16,e4m3,f32+e4m3,f32+e4m3sr,f32+bf16} --out $R/bench > $R/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - t0 )) s" >> $R/bench.log
export REPLAYSSM_AOT_DIR=/tmp/aot-san REPLAYSSM_JIT_DEBUG=1
FMTS="--families gdn --formats f32+e4m3,f32+e4m3+sr --outputs nan"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool memcheck --kernel-name kns=_kernel --padding 65536 --report-api-errors explicit \
  python3 scripts/sanitize_kernels.py $FMTS --time-budget 40 > $R/memcheck.log 2>&1; echo "memcheck rc=$?" >> $R/memcheck.log
timeout 60 compute-sanitizer --tool racecheck --kernel-name kns=_kernel --racecheck-report analysis \
  python3 scripts/sanitize_kernels.py $FMTS --time-budget 40 > $R/racecheck.log 2>&1; echo "racecheck rc=$?" >> $R/racecheck.log
for f in $R/*.log; do echo "== $f"; tail -n 12 $f; done
cd /tmp && tar czf $OUT/res.tgz res
