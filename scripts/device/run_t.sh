# GPU call T (issue 40's one run; about 400 s): the GPU tests of what this tree changed (the
# records kernels' and the per-item replay step's dt / gates beside the cursor; 16-bit checkpoints
# flushing every token at batch 1), then every Mamba-2 checkpoint format at super120b, batches 1, 8,
# 64 and 256 (bench_mamba2.py: conventional, non-flush, flush, amortized, staggered), then
# FlashInfer's checkpointing_ssu and selective_state_update with FP32, FP16, BF16 and FP8 state at
# the same batches (anchor_lp_spec.py, autotuned at batch 256 included), and GDN (qwen122b) and KDA
# (kimi48b) formats beside fla's steps (bench_gdn.py), on one machine.
# Modules: .device/tests-aot.tar.xz (the h200 preset; the tests compile the rest),
# .device/grand-aot.tar.xz (ours) and .device/fi-lp.tar.xz (FlashInfer's), built on the CPU machine.
set -u
source .device/prelude.sh || exit 1
python3 -c "import flashinfer" 2>/dev/null || tar xJf .device/flashinfer.tar.xz -C /tmp/site
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_MAX_JOBS=16
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > $OUT/device.txt
mkdir -p /tmp/aot-grand /tmp/aot-tests /tmp/fi
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
