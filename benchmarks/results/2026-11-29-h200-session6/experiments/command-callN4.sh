#!/usr/bin/env bash
# Call N4 (prepared for the next session): where GDN's flush step goes. ncu on qwen4b's and
# qwen122b's state kernels at batch 256, L = 16 (conventional, split non-flush, split flush) and
# on the records kernel, from snapFin2/aotFin2 (the kernels of main at 6c16400; GDN SASS identical).
# Compare the flush state kernel's duration, issue stalls and achieved occupancy with the
# conventional kernel's (qwen4b in the sweep: flush 354.8 us against 273.8 conventional).
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapFin2
export PYTHONUNBUFFERED=1
[ -d /tmp/aotFin2 ] || { mkdir -p /tmp/aotFin2 && tar xJf $D/aotFin2.tar.xz -C /tmp/aotFin2 --strip-components=1; }
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=/tmp/aotFin2
R=$OUT/run; mkdir -p $R; cd $S
SEC="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis"
for shape in ${N4_SHAPES:-qwen4b qwen122b}; do
  timeout 150 ncu --clock-control none --kernel-name-base demangled -k regex:"gdn::(State|Kernel|Records)<" $SEC \
    python3 benchmarks/profile_steps.py --single --family gdn --shapes $shape --out $R/x-$shape > $R/ncu-$shape.txt 2>&1
  grep -E "gdn::(State|Kernel|Records)<|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Warp Per Scheduler|No Eligible|FMA|Stall" $R/ncu-$shape.txt | cut -c1-120
done
cd $OUT && tar czf run.tgz run && rm -rf run
