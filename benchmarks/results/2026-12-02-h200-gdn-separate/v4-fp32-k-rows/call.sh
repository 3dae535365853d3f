#!/usr/bin/env bash
# Call 9: GDN separate flush from FP32 k copies: tests (incl. BF16 activations) and speed at qwen122b b256.
set -uo pipefail
source .device/prelude.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 REPLAYSSM_CACHE_DIR=/tmp/replayssm-cache
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
unset REPLAYSSM_LAUNCH
R=$OUT/res; mkdir -p $R
echo "commit $(cat .device/commit.txt)" > $R/env.txt
t0=$(date +%s)
python3 .device/build_specs.py .device/specs-call9.pkl /tmp/aot 14 > $R/build.log 2>&1; echo "build rc=$? $(( $(date +%s) - t0 )) s" | tee -a $R/build.log
export REPLAYSSM_AOT_DIR=/tmp/aot REPLAYSSM_DISABLE_JIT=1
timeout 60 python3 -m pytest tests/test_checkpoint_formats.py -m gpu -k "gdn and (carried or split_steps or steps_match or bf16_activations)" -q -rs -p no:cacheprovider > $R/formats.log 2>&1; echo "rc=$?" >> $R/formats.log
tail -3 $R/formats.log
timeout 60 python3 benchmarks/bench_gdn.py --shapes qwen122b --batches 256 --windows 16 --window-sweep 16 --no-fla --states f32+e4m3 --out $R/bench > $R/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - t0 )) s" >> $R/bench.log
tail -3 $R/bench.log
