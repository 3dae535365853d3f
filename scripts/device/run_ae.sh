# GPU call AE (issue 40, profiles): ncu over benchmarks/profile_steps.py --single (one conventional,
# one non-flush at held 8 and one flush step): GDN separate FP32 + e4m3 at qwen122b batch 256 (the
# flush call AD missed); super120b BF16 and BF16 + SR at batch 1 (flush every step, 5.6 against
# 4.4 us with SR); and KDA's records kernel at kimi48b batch 256 with its stall sampling by SASS
# line. Tree: main as sent (a-src), grand-aot. Output: $OUT/run.tgz.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_DISABLE_JIT=1
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
R=/tmp/run; mkdir -p $R /tmp/a /tmp/aot-a
pack() { tar czf $OUT/run.tgz -C $R .; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
tar xJf .device/a-src.tar.xz -C /tmp/a; tar xJf .device/grand-aot.tar.xz -C /tmp/aot-a
cd /tmp/a
export PYTHONPATH=/tmp/a:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-a
SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section InstructionStats --section LaunchStats --section MemoryWorkloadAnalysis"
prof() {  # name family shape state batch [extra ncu args]
  local name=$1 family=$2 shape=$3 state=$4 batch=$5; shift 5
  timeout 120 ncu --clock-control none --kernel-name-base demangled -k regex:replayssm $SECTIONS "$@" --csv --page details \
    python3 benchmarks/profile_steps.py --family $family --shapes $shape --states $state --batch $batch --single \
    --min-pool-bytes 3e8 --out /tmp/profile-$name > $R/ncu-$name.csv 2> $R/ncu-$name.err
  echo "== $name rc=$? at $(elapsed): $(wc -l < $R/ncu-$name.csv) lines"; pack
}
prof qwen122b-f32-e4m3-b256 gdn qwen122b f32+e4m3 256
prof super120b-bf16sr-b1 mamba2 super120b bf16sr 1
prof super120b-bf16-b1 mamba2 super120b bf16 1
timeout 150 ncu --clock-control none --kernel-name-base demangled -k regex:Records -c 2 --section WarpStateStats \
  --section SourceCounters --section InstructionStats --print-details all \
  python3 benchmarks/profile_steps.py --family gdn --shapes kimi48b --states f32 --batch 256 --single \
  --min-pool-bytes 3e8 --out /tmp/profile-kda > $R/ncu-kimi48b-records-source.txt 2>&1
echo "== kda records rc=$? at $(elapsed)"; pack
