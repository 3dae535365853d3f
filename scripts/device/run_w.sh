# GPU call W (issue 40; about 500 s): branch issue40's GPU tests, an A/B of the policy's steps at
# batches 1 and 8 against main before the branch (fe20978: its tree and modules,
# .device/head-src.tar.xz and .device/m2-aot.tar.xz), then every Mamba-2 format at batches 1-256,
# FlashInfer's checkpointing_ssu, and GDN / KDA beside fla, on one machine.
set -u
source .device/prelude.sh || exit 1
python3 -c "import flashinfer" 2>/dev/null || tar xJf .device/flashinfer.tar.xz -C /tmp/site
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_MAX_JOBS=16
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > $OUT/device.txt
mkdir -p /tmp/aot-grand /tmp/aot-tests /tmp/fi /tmp/head /tmp/aot-m2
tar xJf .device/head-src.tar.xz -C /tmp/head && tar xJf .device/m2-aot.tar.xz -C /tmp/aot-m2
tar xJf .device/grand-aot.tar.xz -C /tmp/aot-grand && tar xJf .device/fi-lp.tar.xz -C /tmp/fi
tar xJf .device/tests-aot.tar.xz -C /tmp/aot-tests
export PYTHONPATH=$PWD:/tmp/site
REPLAYSSM_AOT_DIR=/tmp/aot-tests timeout -s INT -k 10 85 python3 -m pytest -p no:cacheprovider -m gpu -rfE -q \
  tests/mamba2/test_mamba2_gpu.py tests/gdn/test_gdn_gpu.py tests/kda/test_kda_gpu.py \
  -k "split_matches or split_agrees or split_variant or flush_every_step or sixteen_bit or switching or bad_input" \
  > $OUT/tests.txt 2>&1
echo "== tests rc=$? at $(elapsed): $(grep -E '[0-9]+ (passed|failed)' $OUT/tests.txt | tail -1)"
grep -E "^(FAILED|ERROR)" $OUT/tests.txt | head -20
export REPLAYSSM_AOT_DIR=/tmp/aot-grand REPLAYSSM_DISABLE_JIT=1
AB="benchmarks/bench_mamba2.py --shapes super120b --batches 1,8 --window-sweep 16 --min-pool-bytes 3e8 --states bf16,e4m3,f32"
(cd /tmp/head && PYTHONPATH=/tmp/head:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-m2 timeout 45 python3 $AB --out $OUT/ab-before > $OUT/ab-before.txt 2>&1)
timeout 45 python3 $AB --out $OUT/ab-after > $OUT/ab-after.txt 2>&1
echo "== A/B at $(elapsed)"; grep -hE "^\(" $OUT/ab-before.txt $OUT/ab-after.txt | cut -c1-200
timeout 145 python3 benchmarks/bench_mamba2.py --shapes super120b --batches 1,8,64,256 --window-sweep 16 \
  --min-pool-bytes 3e8 --states f32+e4m3,e4m3,f32+nvfp4,bf16,bf16sr,f32 --out $OUT/ours > $OUT/mamba2.txt 2>&1
echo "== ours rc=$? at $(elapsed)"; grep -E "^\(" $OUT/mamba2.txt | cut -c1-230
FLASHINFER_DISABLE_JIT=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 timeout 80 python3 .device/anchors/anchor_lp_spec.py \
  --aot-dir /tmp/fi/fi-f32 --aot-dir /tmp/fi/fi-lp --skip spec --tune-dtypes f32,bf16 --batches 256,64,8,1 \
  --min-pool-bytes 1e9 --out $OUT/fi > $OUT/fi.txt 2>&1
echo "== FlashInfer rc=$? at $(elapsed)"; tail -12 $OUT/fi.txt | cut -c1-200
G="benchmarks/bench_gdn.py --batches 1,8,64,256 --window-sweep 16 --min-pool-bytes 3e8"
timeout 45 python3 $G --shapes qwen122b --states f32,f32+e4m3 --out $OUT/ours-gdn > $OUT/gdn.txt 2>&1
echo "== gdn rc=$? at $(elapsed)"; grep -E "^\(" $OUT/gdn.txt | cut -c1-230
timeout 25 python3 $G --shapes kimi48b --states f32 --out $OUT/ours-kda > $OUT/kda.txt 2>&1
echo "== kda rc=$? at $(elapsed)"; grep -E "^\(" $OUT/kda.txt | cut -c1-230
