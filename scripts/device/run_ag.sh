# GPU call AG (issue 40, small batches; written in session 33, not yet run): (1) ncu of super120b
# BF16 and BF16 + SR at batch 1 in flush-every-step mode (nothing held) beside the conventional
# step: the 5.6 against 4.4 us gap of BF16 + SR that early arrival did not close; (2) the
# Mamba-2 per-item tile rule's A/B at batch 1 (the 16-row tile it replaced, forced, against the
# policy), which call AF's 60 s limit cut (a (state, batch) config takes about 15 s). Modules:
# grand-aot, current for the tree sent. Output: $OUT/run.tgz.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_DISABLE_JIT=1
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
R=/tmp/run; mkdir -p $R /tmp/aot
pack() { tar czf $OUT/run.tgz -C $R .; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
git rev-parse HEAD > $R/commit.txt 2>/dev/null || true
tar xJf .device/grand-aot.tar.xz -C /tmp/aot
export REPLAYSSM_AOT_DIR=/tmp/aot
for state in bf16 bf16sr; do
  PYTHONPATH=$PWD:/tmp/site timeout 90 ncu --clock-control none --kernel-name-base demangled -k regex:replayssm \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section LaunchStats --section SourceCounters --print-details all \
    python3 benchmarks/profile_steps.py --family mamba2 --shapes super120b --states $state --batch 1 --held 0 \
    --single --launch kernel=flush-every-step --min-pool-bytes 3e8 --out /tmp/profile-$state > $R/ncu-$state-b1.txt 2>&1
  echo "== ncu $state rc=$? at $(elapsed)"; pack
done
# The rule's A/B in one tree: A forces the 16-row tile the rule replaced (the conventional step's
# tile is 16 rows either way; NVFP4 has only its whole-head tile, so it is left out).
B1="--batches 1 --window-sweep 16 --window-sweep-batch 1 --min-pool-bytes 3e8 --states e4m3,f32+e4m3"
for round in 1 2; do
  for side in a b; do
    launch=""; [ $side = a ] && launch="--launch rows_per_cta=16"
    PYTHONPATH=$PWD:/tmp/site timeout 120 python3 benchmarks/bench_mamba2.py --shapes super120b $B1 $launch \
      --out $R/$side-$round > $R/$side-$round.txt 2>&1
    echo "== $side round $round rc=$? at $(elapsed)"; pack
  done
done
grep -HE "^\(" $R/*.txt | cut -c1-220
