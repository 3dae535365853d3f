# GPU call J (issue 39, next step; not yet run; about 150 s): where main's per-item verify spends a
# small batch since the shared-row writes and the 32-row tile. ncu at super120b, T = 4, batch 1
# (32-row tile) and 8 (64-row tile): duration, occupancy, stalls, and the per-SASS stall samples.
source scripts/device/suites.sh
NCU="ncu --clock-control none --kernel-name-base demangled --launch-skip 2 -c 1"
for b in 1 8; do
  ONE="python3 benchmarks/bench_verify.py --no-baselines --verify-kernels= --no-fla --shapes super120b \
    --batches $b --ts 4 --reps 1 --rounds 1 --cycle-steps 1 --min-pool-bytes 6e8 --out /tmp/ncu-out"
  in_tree main timeout 60 $NCU -k 'regex:mamba2::Verify<' --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis $ONE > $OUT/b$b-details.txt 2>&1
  in_tree main timeout 60 $NCU -k 'regex:mamba2::Verify<' --section SourceCounters --section WarpStateStats \
    --page source --print-source sass --csv $ONE 2> $OUT/b$b-sass.err | xz -6 > $OUT/b$b-sass.csv.xz
  echo "== batch $b at $(elapsed)"; grep -E "Duration|Registers Per|Achieved Occupancy|SM Active" $OUT/b$b-details.txt
done
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
