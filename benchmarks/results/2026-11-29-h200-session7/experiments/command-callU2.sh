#!/usr/bin/env bash
# Call U2: where the GDN records kernel's instructions go (final main, snapF/aotW: 4-warp records CTAs at qwen4b): ncu source
# counters (SASS, per instruction: executed warp instructions, stall samples) for the first
# records launch of profile_steps --single (qwen4b, batch 256, L = 16, non-flush, held 8).
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapF
export PYTHONUNBUFFERED=1
[ -d /tmp/aotW ] || { mkdir -p /tmp/aotW && tar xJf $D/aotW.tar.xz -C /tmp/aotW --strip-components=1; }
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=/tmp/aotW
R=$OUT/run; mkdir -p $R; cd $S
timeout 200 ncu --clock-control none --kernel-name-base demangled -k regex:"gdn::Records<" -c 1 \
  --section SourceCounters --section InstructionStats --section WarpStateStats --section LaunchStats --section Occupancy --section SpeedOfLight \
  -o $R/rec python3 benchmarks/profile_steps.py --single --family gdn --shapes qwen4b --out $R/x > $R/ncu.txt 2>&1
tail -5 $R/ncu.txt
ncu -i $R/rec.ncu-rep --page details > $R/details.txt 2>&1; grep -E "Duration|Executed Inst|Issued|IPC|Warp Cycles" $R/details.txt | head
ncu -i $R/rec.ncu-rep --page source --csv --print-source sass > $R/sass.csv 2> $R/sass.err; wc -l $R/sass.csv; head -c 600 $R/sass.err
head -3 $R/sass.csv | cut -c1-400
timeout 150 ncu --clock-control none --kernel-name-base demangled -k regex:"gdn::State<" --launch-skip 1 -c 1 \
  --section SourceCounters --section WarpStateStats --section Occupancy --section SpeedOfLight --section ComputeWorkloadAnalysis \
  -o $R/stateflush python3 benchmarks/profile_steps.py --single --family gdn --shapes qwen4b --out $R/x2 > $R/ncu2.txt 2>&1
ncu -i $R/stateflush.ncu-rep --page details > $R/details2.txt 2>&1; grep -E "Duration|Stall|Warp Cycles|Achieved Occ|FMA|Issue Slots" $R/details2.txt | head -20
ncu -i $R/stateflush.ncu-rep --page source --csv --print-source sass > $R/sass2.csv 2>/dev/null; wc -l $R/sass2.csv
cd $OUT && tar czf run.tgz run && rm -rf run
