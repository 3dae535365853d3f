#!/usr/bin/env bash
# Call 1: re-run the family GPU suites (modules changed in SASS last session) + read_rn tests + accuracy row.
set -uo pipefail
source .device/prelude.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 REPLAYSSM_CACHE_DIR=/tmp/replayssm-cache
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
unset REPLAYSSM_LAUNCH
R=/tmp/res; mkdir -p $R
echo "commit $(cat .device/commit.txt)" > $R/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >> $R/env.txt
T=${LIMIT:-500}
run() { local name=$1; shift; ( timeout $T "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log ) & }
run mamba2 python3 -m pytest tests/test_mamba2_gpu.py -m gpu -q -rs -p no:cacheprovider
run gdn python3 -m pytest tests/test_gdn_gpu.py -m gpu -q -rs -p no:cacheprovider
run kda python3 -m pytest tests/test_kda_gpu.py -m gpu -q -rs -p no:cacheprovider
run srtwin python3 -m pytest tests/test_sr_twin_gpu.py tests/test_seed_tensor_gpu.py -m gpu -q -rs -p no:cacheprovider
run formats python3 -m pytest tests/test_checkpoint_formats.py -m gpu -q -rs -p no:cacheprovider
run verify-super python3 -m pytest tests/test_verify_gpu.py -m gpu -q -p no:cacheprovider -k super120b
run verify-qwen4b python3 -m pytest tests/test_verify_gpu.py -m gpu -q -p no:cacheprovider -k qwen4b
run acc python3 benchmarks/accuracy_kernels.py --family mamba2 --device cuda --configs "separate FP16+SR + FP8" --out $R/acc
wait
for f in $R/*.log; do echo "== $f"; tail -n 4 $f; done
cd /tmp && tar czf $OUT/res.tgz res
