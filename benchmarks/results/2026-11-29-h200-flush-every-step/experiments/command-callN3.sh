#!/usr/bin/env bash
# Call N3: ncu at batch 1 in steady state (held = 0): the conventional per-item kernel against
# the flush-every-step kernel, super120b and qwen4b.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapF
export PYTHONUNBUFFERED=1
[ -d /tmp/aotF ] || { mkdir -p /tmp/aotF && tar xJf $D/aotF.tar.xz -C /tmp/aotF --strip-components=1; }
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=/tmp/aotF
R=$OUT/run; mkdir -p $R; cd $S
SEC="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats"
for f in mamba2:super120b gdn:qwen4b; do
  timeout 60 ncu --clock-control none --kernel-name-base demangled -k regex:"(gdn|mamba2)::Kernel<" $SEC \
    python3 benchmarks/profile_steps.py --single --family ${f%%:*} --shapes ${f#*:} --batch 1 --held 0 --out $R/x > $R/ncu-${f#*:}-b1-held0.txt 2>&1
  grep -E "::Kernel<|Duration|Registers Per|Dynamic Shared|Achieved Occupancy|Issued Warp Per Scheduler|No Eligible|Warp Cycles Per Issued|Grid Size|Block Size" $R/ncu-${f#*:}-b1-held0.txt | cut -c1-100
done
cd $OUT && tar czf run.tgz run && rm -rf run
