# GPU call S (issue 40; about 300 s): every Mamba-2 launch variant (bench_mamba2.py --tiling-sweep)
# where issue 40 says the policy loses: super120b BF16, e4m3 and FP32 at batches 1 and 8 (against
# each format's own conventional step), nano4b FP32 at batch 8 (autotune beat the policy), and the
# e4m3 formats at batch 256. Runs main's tree as of fe20978 (.device/head-src.tar.xz, a git archive)
# with its modules (.device/m2-aot.tar.xz).
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > $OUT/device.txt
mkdir -p /tmp/aot-m2 /tmp/head && tar xJf .device/m2-aot.tar.xz -C /tmp/aot-m2 && tar xJf .device/head-src.tar.xz -C /tmp/head
cd /tmp/head
PYTHONPATH=$PWD:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-m2 REPLAYSSM_DISABLE_JIT=1 timeout 480 \
  python3 benchmarks/bench_mamba2.py --batches none --shapes super120b --states e4m3 --window-sweep 16 --min-pool-bytes 6e8 \
  --tiling-sweep super120b:1:16:bf16,super120b:8:16:bf16,super120b:1:16:e4m3,super120b:8:16:e4m3,super120b:1:16:f32,super120b:8:16:f32+e4m3,nano4b:8:16:f32,super120b:256:16:e4m3,super120b:256:16:f32+e4m3 \
  --out $OUT/sweep > $OUT/sweep.txt 2>&1
echo "rc=$?"; tail -30 $OUT/sweep.txt | cut -c1-400
