# GPU call V (issue 40; about 230 s: the device time left after six refused starts): the GPU tests
# of what this tree changed (the records kernels' and the per-item replay step's dt / gates beside
# the cursor; 16-bit checkpoints flushing every token at batch 1), an A/B of the policy's steps at
# batches 1 and 8 against main before this session (fe20978: its tree and modules), then the
# issue's formats at batch 256. Modules: .device/tests-aot.tar.xz (the h200 preset),
# .device/grand-aot.tar.xz, .device/head-src.tar.xz and .device/m2-aot.tar.xz.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_MAX_JOBS=16
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > $OUT/device.txt
mkdir -p /tmp/aot-grand /tmp/aot-tests /tmp/head /tmp/aot-m2
tar xJf .device/tests-aot.tar.xz -C /tmp/aot-tests && tar xJf .device/grand-aot.tar.xz -C /tmp/aot-grand
tar xJf .device/head-src.tar.xz -C /tmp/head && tar xJf .device/m2-aot.tar.xz -C /tmp/aot-m2
export PYTHONPATH=$PWD:/tmp/site
REPLAYSSM_AOT_DIR=/tmp/aot-tests timeout -s INT -k 10 85 python3 -m pytest -p no:cacheprovider -m gpu -rfE -q \
  tests/mamba2/test_mamba2_gpu.py tests/gdn/test_gdn_gpu.py tests/kda/test_kda_gpu.py \
  -k "split_matches or split_agrees or split_variant or flush_every_step or sixteen_bit or switching or bad_input" \
  > $OUT/tests.txt 2>&1
echo "== tests rc=$? at $(elapsed): $(grep -E '[0-9]+ (passed|failed)' $OUT/tests.txt | tail -1)"
grep -E "^(FAILED|ERROR)" $OUT/tests.txt | head -20
export REPLAYSSM_DISABLE_JIT=1
AB="benchmarks/bench_mamba2.py --shapes super120b --batches 1,8 --window-sweep 16 --min-pool-bytes 3e8 --states bf16,e4m3,f32"
(cd /tmp/head && PYTHONPATH=/tmp/head:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-m2 timeout 45 python3 $AB --out $OUT/ab-before > $OUT/ab-before.txt 2>&1)
REPLAYSSM_AOT_DIR=/tmp/aot-grand timeout 45 python3 $AB --out $OUT/ab-after > $OUT/ab-after.txt 2>&1
echo "== A/B at $(elapsed)"; grep -hE "^\(" $OUT/ab-before.txt $OUT/ab-after.txt | cut -c1-200
REPLAYSSM_AOT_DIR=/tmp/aot-grand timeout 60 python3 benchmarks/bench_mamba2.py --shapes super120b --batches 256 \
  --window-sweep 16 --min-pool-bytes 1e9 --states f32+e4m3,e4m3,f32+nvfp4,bf16 --out $OUT/ours > $OUT/mamba2.txt 2>&1
echo "== formats rc=$? at $(elapsed)"; grep -E "^\(" $OUT/mamba2.txt | cut -c1-230
