#!/usr/bin/env bash
# Call N2: ncu on F's Mamba-2 state kernels at batch 256 (conventional, split non-flush, split
# flush: why the flush state kernel is 20% slower than the conventional step), and on GDN's
# per-item kernels at batch 1 (conventional against flush-every-step).
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapF
export PYTHONUNBUFFERED=1
[ -d /tmp/aotF ] || { mkdir -p /tmp/aotF && tar xJf $D/aotF.tar.xz -C /tmp/aotF --strip-components=1; }
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=/tmp/aotF
R=$OUT/run; mkdir -p $R; cd $S
SEC="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats"
timeout 150 ncu --clock-control none --kernel-name-base demangled -k regex:"mamba2::(State|Kernel)<" $SEC \
  python3 benchmarks/profile_steps.py --single --family mamba2 --shapes super120b --out $R/x > $R/ncu-super120b-state.txt 2>&1
grep -E "mamba2::(State|Kernel)<|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issued Warp Per Scheduler|No Eligible|Dynamic Shared" $R/ncu-super120b-state.txt | cut -c1-110
timeout 90 ncu --clock-control none --kernel-name-base demangled -k regex:"gdn::Kernel<" $SEC \
  python3 benchmarks/profile_steps.py --single --family gdn --shapes qwen4b --batch 1 --out $R/y > $R/ncu-qwen4b-b1.txt 2>&1
grep -E "gdn::Kernel<|Duration|Achieved Occupancy|Registers Per|Issued Warp Per Scheduler|No Eligible|Dynamic Shared" $R/ncu-qwen4b-b1.txt | cut -c1-110
cd $OUT && tar czf run.tgz run && rm -rf run
