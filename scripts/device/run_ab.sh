# GPU call AB (issue 40): the gdn-separate-tile branch's GPU test (its 32-row per-item tile at
# qwen122b batch 1 against the float64 reference, carried copy bit for bit), then call X's
# Mamba-2 tiling sweep (scripts/device/run_x.sh: batch 8 rules, nano4b where autotune once beat
# the policy, e4m3 at 256). Modules: .device/sep-aot and .device/grand-aot. Output: $OUT/run.tgz.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_DISABLE_JIT=1
T0=$(date +%s)
R=/tmp/run; mkdir -p $R /tmp/aot-sep /tmp/aot-grand
pack() { tar czf $OUT/run.tgz -C $R .; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
git rev-parse HEAD > $R/commit.txt 2>/dev/null || true
tar xJf .device/sep-aot.tar.xz -C /tmp/aot-sep; tar xJf .device/grand-aot.tar.xz -C /tmp/aot-grand
REPLAYSSM_AOT_DIR=/tmp/aot-sep PYTHONPATH=$PWD:/tmp/site timeout -s INT -k 10 120 python3 -m pytest -p no:cacheprovider \
  -m gpu -rfE -q "tests/protocol/test_checkpoint_formats_steps.py::test_gdn_separate_per_item_carried_copy_on_the_policys_small_batch_tile" \
  > $R/tile-test.txt 2>&1
echo "== tile test rc=$? at $(( $(date +%s) - T0 )) s: $(tail -1 $R/tile-test.txt)"; pack
PYTHONPATH=$PWD:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-grand timeout 400 \
  python3 benchmarks/bench_mamba2.py --batches none --shapes super120b --states e4m3 --window-sweep 16 --min-pool-bytes 6e8 \
  --tiling-sweep super120b:8:16:f32,nano4b:8:16:f32,super120b:8:16:bf16,super120b:8:16:e4m3,super120b:256:16:e4m3,super120b:256:16:f32+e4m3 \
  --out $R/sweep > $R/sweep.txt 2>&1
echo "== sweep rc=$? at $(( $(date +%s) - T0 )) s"; pack
grep -E "^\(" $R/sweep.txt | cut -c1-300 | tail -60
