# GPU call R (issue 40; about 120 s; not yet run: session 29 had too little device time left): every Mamba-2 launch variant at the small-batch points
# issue 40 names, the policy's beside them in one process (bench_mamba2.py --tiling-sweep):
# super120b BF16 checkpoints at batches 8 and 1 (its batch-8 ratio to the conventional step fell
# between two H200 runs) and nano4b FP32 at batch 8 (where autotune beat the policy, 16.0 against
# 19.0 us on an H200). Modules: .device/m2-aot.tar.xz (model_specs of Mamba-2 at L = 1 and 16,
# BF16 and FP32 checkpoints, T = 1).
source scripts/device/suites.sh
mkdir -p /tmp/aot-m2 && tar xJf .device/m2-aot.tar.xz -C /tmp/aot-m2
(cd /tmp/main && PYTHONPATH=/tmp/main:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-m2 REPLAYSSM_DISABLE_JIT=1 timeout 200 \
  python3 benchmarks/bench_mamba2.py --batches none --min-pool-bytes 6e8 \
  --tiling-sweep super120b:8:16:bf16,super120b:1:16:bf16,nano4b:8:16:f32 --out $OUT/sweep > $OUT/sweep.txt 2>&1)
echo "== sweep at $(elapsed)"; tail -40 $OUT/sweep.txt | cut -c1-200
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
