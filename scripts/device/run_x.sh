# GPU call X (issue 40, small batches and the tile rules; about 400 s): every Mamba-2 launch
# variant (bench_mamba2.py --tiling-sweep) where the 2026-12-05 sweep stopped or left a rule
# untested: FP32 at batch 8 (speculative ring loads against none, before changing
# SPLIT_SPECULATIVE_MAX_RECORDS_CTAS_PER_SM), nano4b FP32 at batch 8 (where autotune once beat the
# policy), BF16 and e4m3 at batch 8 on this tree, and e4m3 / FP32 + e4m3 at batch 256.
# Modules: .device/grand-aot.tar.xz (formats-bench plus nano4b FP32), built on the CPU machine.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_DISABLE_JIT=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > $OUT/device.txt
mkdir -p /tmp/aot-grand && tar xJf .device/grand-aot.tar.xz -C /tmp/aot-grand
PYTHONPATH=$PWD:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-grand timeout 420 \
  python3 benchmarks/bench_mamba2.py --batches none --shapes super120b --states e4m3 --window-sweep 16 --min-pool-bytes 6e8 \
  --tiling-sweep super120b:8:16:f32,nano4b:8:16:f32,super120b:8:16:bf16,super120b:8:16:e4m3,super120b:256:16:e4m3,super120b:256:16:f32+e4m3 \
  --out $OUT/sweep > $OUT/sweep.txt 2>&1
echo "rc=$?"; tail -40 $OUT/sweep.txt | cut -c1-400
