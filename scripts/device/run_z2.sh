# GPU call Z2: what call Z lacked modules for (.device/sep-aot now has them): its 7 GDN
# separate-mode tests (SR and BF16 read copies) and separate mode's launch variants at batches
# 1 and 8 (qwen122b; --window-sweep 16: the sweep's default L values have no modules here).
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_DISABLE_JIT=1
export REPLAYSSM_AOT_DIR=/tmp/aot-sep PYTHONPATH=$PWD:/tmp/site
T0=$(date +%s)
R=/tmp/run; mkdir -p $R /tmp/aot-sep
pack() { tar czf $OUT/run.tgz -C $R .; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
tar xJf .device/sep-aot.tar.xz -C /tmp/aot-sep
timeout -s INT -k 10 90 python3 -m pytest -p no:cacheprovider -m gpu -rfE -q $(cat .device/sep-tests-2.txt) > $R/tests.txt 2>&1
echo "== tests rc=$? at $(( $(date +%s) - T0 )) s: $(grep -E '[0-9]+ (passed|failed)' $R/tests.txt | tail -1)"; pack
timeout 100 python3 benchmarks/bench_gdn.py --batches none --window-sweep 16 --shapes qwen122b --states f32 --no-fla \
  --min-pool-bytes 3e8 --tiling-sweep qwen122b:1:16:f32+e4m3,qwen122b:8:16:f32+e4m3 --out $R/sweep > $R/sweep.txt 2>&1
echo "== sweep rc=$? at $(( $(date +%s) - T0 )) s"; pack
grep -E "^\(" $R/sweep.txt | cut -c1-300
