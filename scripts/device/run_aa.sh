# GPU call AA (issue 40, next): Nsight Compute of GDN separate mode's split flush at qwen122b,
# batch 256 (1716 us on the H100 after the held weights moved to the records kernel, against
# FP32's 858). Captures 20 launches of the split state kernel over an L = 16 cycle: the flush is
# the one whose duration is about 8x the others'. Sections: speed of light, occupancy, warp
# stalls, instruction mix, launch. Modules: .device/sep-aot.tar.xz (main's gdn/ templates).
# Output: $OUT/run.tgz (ncu text; summarize with scripts/ncu_summary.py).
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 REPLAYSSM_DISABLE_JIT=1 REPLAYSSM_AOT_DIR=/tmp/aot-sep PYTHONPATH=$PWD:/tmp/site
R=/tmp/run; mkdir -p $R /tmp/aot-sep
pack() { tar czf $OUT/run.tgz -C $R .; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
tar xJf .device/sep-aot.tar.xz -C /tmp/aot-sep
ONE="benchmarks/bench_gdn.py --shapes qwen122b --states f32+e4m3 --batches 256 --window-sweep 16 --no-fla \
  --reps 1 --rounds 1 --min-pool-bytes 3e8 --out /tmp/ncu-out"
timeout 400 ncu --clock-control none --kernel-name-base demangled -k 'regex:gdn::State' --launch-skip 40 -c 20 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section InstructionStats \
  --section LaunchStats --section ComputeWorkloadAnalysis python3 $ONE > $R/ncu-qwen122b-b256-sep.txt 2>&1
echo "== ncu rc=$?"; pack
grep -E "gdn::State|Duration|Achieved Occupancy|Issue Slots Busy|No Eligible" $R/ncu-qwen122b-b256-sep.txt | cut -c1-140 | head -60
