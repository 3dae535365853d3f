# GPU call G (issue 39, next step; not yet run): where the split verify's records kernel spends its
# issue slots. ncu's per-SASS-instruction stall samples (source page, SASS view) of VerifyRecords at
# super120b, batch 256, T = 4 and 8, and of the e4m3 / NVFP4 non-flush state kernels (issue 40).
# Compressed CSVs under $OUT (the raw pages are large).
# RECORDS_ONLY=1 (as run_f.sh calls it): the records kernel only.
source scripts/device/suites.sh
for t in 4 8; do
  in_tree main timeout 150 ncu --clock-control none --kernel-name-base demangled -k regex:VerifyRecords -c 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    python3 benchmarks/bench_verify.py --shapes super120b --batches 256 --ts $t --verify-kernels split \
    --reps 1 --rounds 1 --cycle-steps 1 --min-pool-bytes 6e8 --no-fla --out /tmp/ncu-out \
    2> $OUT/records-T$t.err | xz -6 > $OUT/records-T$t-sass.csv.xz
  echo "== records T=$t at $(elapsed)"
done
[ -n "${RECORDS_ONLY:-}" ] && exit 0
for states in f32+e4m3 f32+nvfp4; do
  in_tree main timeout 120 ncu --clock-control none --kernel-name-base demangled -k regex:State -c 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    python3 benchmarks/profile_steps.py --family mamba2 --shapes super120b --states $states --single \
    --min-pool-bytes 6e8 --out /tmp/profile-$states 2> $OUT/state-$states.err | xz -6 > $OUT/state-${states/+/-}-sass.csv.xz
  echo "== state $states at $(elapsed)"
done
# GDN's separate flush (qwen122b FP32 + e4m3: 2.4 ms, compute-bound in the recompute of held u):
# the second State launch of profile_steps --single is the flush step's.
in_tree main timeout 150 ncu --clock-control none --kernel-name-base demangled -k regex:State --launch-skip 1 -c 1 \
  --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
  python3 benchmarks/profile_steps.py --family gdn --shapes qwen122b --states f32+e4m3 --single \
  --min-pool-bytes 6e8 --out /tmp/profile-gdn-flush 2> $OUT/gdn-flush.err | xz -6 > $OUT/gdn-flush-sass.csv.xz
echo "== gdn separate flush at $(elapsed)"
