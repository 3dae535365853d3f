# GPU call U (issue 40's one run, part 2; about 280 s, after call T): GDN (qwen122b) and KDA
# (kimi48b) checkpoint formats at batches 1, 8, 64 and 256 beside fla's conventional steps
# (bench_gdn.py), then an A/B at batches 1 and 8 against main before this session (fe20978, its
# tree and modules: .device/head-src.tar.xz, .device/m2-aot.tar.xz). Modules: .device/grand-aot.tar.xz.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > $OUT/device.txt
mkdir -p /tmp/aot-grand /tmp/head /tmp/aot-m2
tar xJf .device/grand-aot.tar.xz -C /tmp/aot-grand
tar xJf .device/head-src.tar.xz -C /tmp/head && tar xJf .device/m2-aot.tar.xz -C /tmp/aot-m2
export PYTHONPATH=$PWD:/tmp/site REPLAYSSM_DISABLE_JIT=1
G="benchmarks/bench_gdn.py --batches 1,8,64,256 --window-sweep 16 --min-pool-bytes 3e8"
REPLAYSSM_AOT_DIR=/tmp/aot-grand timeout 130 python3 $G --shapes qwen122b --states f32,bf16,e4m3,f32+e4m3 \
  --out $OUT/ours-gdn > $OUT/gdn.txt 2>&1
echo "== gdn rc=$? at $(elapsed)"; grep -E "^\(" $OUT/gdn.txt | cut -c1-230
REPLAYSSM_AOT_DIR=/tmp/aot-grand timeout 80 python3 $G --shapes kimi48b --states f32,bf16 --out $OUT/ours-kda > $OUT/kda.txt 2>&1
echo "== kda rc=$? at $(elapsed)"; grep -E "^\(" $OUT/kda.txt | cut -c1-230
AB="benchmarks/bench_mamba2.py --shapes super120b --batches 1,8 --window-sweep 16 --min-pool-bytes 3e8 --states f32,bf16,e4m3"
(cd /tmp/head && PYTHONPATH=/tmp/head:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-m2 timeout 45 python3 $AB --out $OUT/ab-before > $OUT/ab-before.txt 2>&1)
REPLAYSSM_AOT_DIR=/tmp/aot-grand timeout 45 python3 $AB --out $OUT/ab-after > $OUT/ab-after.txt 2>&1
echo "== A/B at $(elapsed)"; grep -hE "^\(" $OUT/ab-before.txt $OUT/ab-after.txt | cut -c1-200
