# GPU call AF (issue 40, small batches): (1) the GPU tests of the per-item tiles the policy now
# takes at batch 1 (Mamba-2 windowed: 32 rows; GDN separate: 32 rows), JIT-built here; (2) A/B at
# batch 1 of main before both tile rules (a-src, f48295b) against this tree (b-src): super120b
# e4m3, FP32 + e4m3 and FP32 + NVFP4, qwen122b FP32 + e4m3, rounds A B B A. The two trees share
# their modules (grand-aot): the rules are Python. Output: $OUT/run.tgz.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_MAX_JOBS=16
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
R=/tmp/run; mkdir -p $R /tmp/a /tmp/b /tmp/aot-a /tmp/aot-sep
pack() { tar czf $OUT/run.tgz -C $R .; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
tar xJf .device/a-src.tar.xz -C /tmp/a; tar xJf .device/b-src.tar.xz -C /tmp/b
tar xJf .device/grand-aot.tar.xz -C /tmp/aot-a; tar xJf .device/sep-aot.tar.xz -C /tmp/aot-sep
(cd /tmp/b && PYTHONPATH=/tmp/b:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-sep REPLAYSSM_DISABLE_JIT=0 timeout -s INT -k 10 170 \
  python3 -m pytest -p no:cacheprovider -m gpu -rfE -q tests/protocol/test_checkpoint_formats_steps.py \
  -k "policys_small_batch_tile" > $R/tests.txt 2>&1)
echo "== tests rc=$? at $(elapsed): $(tail -1 $R/tests.txt)"; pack
export REPLAYSSM_DISABLE_JIT=1 REPLAYSSM_AOT_DIR=/tmp/aot-a
B1="--batches 1 --window-sweep 16 --window-sweep-batch 1 --min-pool-bytes 3e8"
bench() {  # tree round
  (cd /tmp/$1 && PYTHONPATH=/tmp/$1:/tmp/site timeout 60 python3 benchmarks/bench_mamba2.py --shapes super120b $B1 \
    --states e4m3,f32+e4m3,f32+nvfp4 --out $R/$1-$2-mamba2 > $R/$1-$2-mamba2.txt 2>&1)
  echo "== $1 round $2 mamba2 rc=$? at $(elapsed)"
  (cd /tmp/$1 && PYTHONPATH=/tmp/$1:/tmp/site timeout 40 python3 benchmarks/bench_gdn.py --shapes qwen122b $B1 \
    --states f32+e4m3 --no-fla --out $R/$1-$2-gdn > $R/$1-$2-gdn.txt 2>&1)
  echo "== $1 round $2 gdn rc=$? at $(elapsed)"; pack
}
bench a 1; bench b 1; bench b 2; bench a 2
grep -HE "^\(" $R/*-mamba2.txt $R/*-gdn.txt | cut -c1-220
