#!/usr/bin/env bash
# Call 2: NVFP4 (and the formats suite) on prebuilt modules; accuracy study; rest of mamba2/gdn GPU suites (JIT).
set -uo pipefail
source .device/prelude.sh || exit 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 REPLAYSSM_CACHE_DIR=/tmp/replayssm-cache
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
unset REPLAYSSM_LAUNCH
R=/tmp/res; mkdir -p $R
echo "commit $(cat .device/commit.txt)" > $R/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >> $R/env.txt
run() { local name=$1 lim=$2; shift 2; ( timeout $lim "$@" > $R/$name.log 2>&1; echo "rc=$?" >> $R/$name.log ) & }
run m2rest 430 python3 -m pytest -q -rs -p no:cacheprovider $(cat .device/m2rest.txt)
run gdnrest 430 python3 -m pytest -q -rs -p no:cacheprovider $(cat .device/gdnrest.txt)
t0=$(date +%s)
python3 .device/build_specs.py .device/specs-call2.pkl /tmp/aot 12 > $R/build.log 2>&1; echo "build rc=$? $(( $(date +%s) - t0 )) s" | tee -a $R/build.log
export REPLAYSSM_AOT_DIR=/tmp/aot
run formats 240 python3 -m pytest tests/test_checkpoint_formats.py -m gpu -q -rs -p no:cacheprovider
run acc 240 python3 benchmarks/accuracy_kernels.py --family mamba2 --device cuda --out $R/acc
wait
for f in $R/*.log; do echo "== $f"; tail -n 6 $f; done
cd /tmp && tar czf $OUT/res.tgz res
