#!/usr/bin/env bash
# Call U: where the GDN records kernel's instructions go (main's kernels, snapQ/aotQ): ncu source
# counters (SASS, per instruction: executed warp instructions, stall samples) for the first
# records launch of profile_steps --single (qwen4b, batch 256, L = 16, non-flush, held 8).
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapQ
export PYTHONUNBUFFERED=1
[ -d /tmp/aotQ ] || { mkdir -p /tmp/aotQ && tar xJf $D/aotQ.tar.xz -C /tmp/aotQ --strip-components=1; }
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=/tmp/aotQ
R=$OUT/run; mkdir -p $R; cd $S
timeout 200 ncu --clock-control none --kernel-name-base demangled -k regex:"gdn::Records<" -c 1 \
  --section SourceCounters --section InstructionStats --section WarpStateStats --section LaunchStats --section Occupancy --section SpeedOfLight \
  -o $R/rec python3 benchmarks/profile_steps.py --single --family gdn --shapes qwen4b --out $R/x > $R/ncu.txt 2>&1
tail -5 $R/ncu.txt
ncu -i $R/rec.ncu-rep --page details > $R/details.txt 2>&1; grep -E "Duration|Executed Inst|Issued|IPC|Warp Cycles" $R/details.txt | head
ncu -i $R/rec.ncu-rep --page source --csv --print-source sass > $R/sass.csv 2> $R/sass.err; wc -l $R/sass.csv; head -c 600 $R/sass.err
head -3 $R/sass.csv | cut -c1-400
cd $OUT && tar czf run.tgz run && rm -rf run
