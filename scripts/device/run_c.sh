# GPU call C (issue 39, item 1): ncu over main's split verify kernels at super120b, batch 256,
# T = 4 and 8 (launch, occupancy, stalls, DRAM), before any change to them.
source scripts/device/suites.sh
for t in 4 8; do
  in_tree main timeout 150 ncu --clock-control none --kernel-name-base demangled -k regex:Verify \
    --launch-skip 6 --launch-count 4 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats --csv --page details \
    python3 benchmarks/bench_verify.py --shapes super120b --batches 256 --ts $t \
    --verify-kernels split --reps 1 --rounds 1 --cycle-steps 1 --min-pool-bytes 6e8 --no-fla \
    --out /tmp/ncu-out > $OUT/ncu-verify-T$t.csv 2> $OUT/ncu-verify-T$t.err
  echo "== ncu T=$t at $(elapsed): $(wc -l < $OUT/ncu-verify-T$t.csv) lines"
done
