# GPU call D (issue 40, "profile before changing"): ncu over one conventional, one non-flush and
# one flush step (profile_steps.py --single) of each configuration the table names, at
# batch 256, L = 16; the kernels of our namespace only. One CSV per configuration under $OUT.
source scripts/device/suites.sh
for cfg in "mamba2 super120b f32+e4m3" "mamba2 super120b e4m3" "mamba2 super120b f32+nvfp4" \
           "mamba2 super120b bf16" "mamba2 super120b bf16sr" "gdn qwen122b f32+e4m3" "gdn kimi48b f32"; do
  set -- $cfg
  name=$2-${3/+/-}
  in_tree main timeout 120 ncu --clock-control none --kernel-name-base demangled -k regex:replayssm \
    --launch-count 12 --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section InstructionStats \
    --section LaunchStats --csv --page details \
    python3 benchmarks/profile_steps.py --family $1 --shapes $2 --states $3 --single \
    --min-pool-bytes 6e8 --out /tmp/profile-$name > $OUT/ncu-$name.csv 2> $OUT/ncu-$name.err
  echo "== $name at $(elapsed): $(wc -l < $OUT/ncu-$name.csv) lines"
done
