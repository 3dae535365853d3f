# GPU call AD (issue 40): call X's Mamba-2 launch variants at batch 8 (FP32 speculative ring loads
# against none; nano4b FP32, where autotune once beat the policy; BF16 and e4m3), then call AA's
# Nsight Compute profile of GDN separate mode's split flush at qwen122b batch 256. Tree: main as
# sent (a-src) with grand-aot and sep-aot. Output: $OUT/run.tgz.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_DISABLE_JIT=1
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
R=/tmp/run; mkdir -p $R /tmp/a /tmp/aot-a /tmp/aot-sep
pack() { tar czf $OUT/run.tgz -C $R .; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
tar xJf .device/a-src.tar.xz -C /tmp/a; tar xJf .device/grand-aot.tar.xz -C /tmp/aot-a; tar xJf .device/sep-aot.tar.xz -C /tmp/aot-sep
cd /tmp/a
PYTHONPATH=/tmp/a:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-a timeout 260 python3 benchmarks/bench_mamba2.py --batches none \
  --shapes super120b --states e4m3 --window-sweep 16 --min-pool-bytes 6e8 \
  --tiling-sweep super120b:8:16:f32,nano4b:8:16:f32,super120b:8:16:bf16,super120b:8:16:e4m3 --out $R/sweep > $R/sweep.txt 2>&1
echo "== sweep rc=$? at $(elapsed)"; pack
PYTHONPATH=/tmp/a:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-sep timeout 280 ncu --clock-control none --kernel-name-base demangled \
  -k 'regex:gdn::State' --launch-skip 40 -c 20 --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section InstructionStats --section LaunchStats --section ComputeWorkloadAnalysis \
  python3 benchmarks/bench_gdn.py --shapes qwen122b --states f32+e4m3 --batches 256 --window-sweep 16 --no-fla \
  --reps 1 --rounds 1 --min-pool-bytes 3e8 --out /tmp/ncu-out > $R/ncu-qwen122b-b256-sep.txt 2>&1
echo "== ncu rc=$? at $(elapsed)"; pack
grep -E "gdn::State|Duration|Achieved Occupancy|Issue Slots Busy|No Eligible" $R/ncu-qwen122b-b256-sep.txt | cut -c1-140 | head -40
