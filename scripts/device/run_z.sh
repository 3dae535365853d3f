# GPU call Z (issue 40, GDN separate mode's flush): the records kernel forms the held u's
# recomputation weights once per (row, value head), the Gram once per key head; the state CTAs
# load them (templates/gdn/held_records.cuh). Runs on this branch's tree with its modules
# (.device/sep-aot: the separate-mode tests' and qwen122b's), then times qwen122b FP32 and
# FP32 + e4m3 on main's tree (.device/main-src, .device/grand-aot) and on this branch, in one
# call, and every launch variant of separate mode at batches 1 and 8. Output: $OUT/run.tgz.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_DISABLE_JIT=1
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
R=/tmp/run; mkdir -p $R /tmp/aot-sep /tmp/aot-grand /tmp/main-src
pack() { tar czf $OUT/run.tgz -C $R .; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
tar xJf .device/sep-aot.tar.xz -C /tmp/aot-sep && tar xJf .device/grand-aot.tar.xz -C /tmp/aot-grand
tar xJf .device/main-src.tar.xz -C /tmp/main-src
REPLAYSSM_AOT_DIR=/tmp/aot-sep PYTHONPATH=$PWD:/tmp/site timeout -s INT -k 10 150 python3 -m pytest -p no:cacheprovider \
  -m gpu -rfE -q $(cat .device/sep-tests.txt) > $R/tests.txt 2>&1
echo "== tests rc=$? at $(elapsed): $(grep -E '[0-9]+ (passed|failed)' $R/tests.txt | tail -1)"; pack
G="benchmarks/bench_gdn.py --shapes qwen122b --states f32,f32+e4m3 --batches 1,8,64,256 --window-sweep 16 --min-pool-bytes 3e8 --no-fla"
for round in 1; do
  (cd /tmp/main-src && REPLAYSSM_AOT_DIR=/tmp/aot-grand PYTHONPATH=/tmp/main-src:/tmp/site timeout 60 python3 $G \
    --out $R/main-$round > $R/main-$round.txt 2>&1); echo "== main $round rc=$? at $(elapsed)"
  REPLAYSSM_AOT_DIR=/tmp/aot-sep PYTHONPATH=$PWD:/tmp/site timeout 60 python3 $G --out $R/branch-$round \
    > $R/branch-$round.txt 2>&1; echo "== branch $round rc=$? at $(elapsed)"; pack
done
# Every launch variant of separate mode at batches 1 and 8 on this branch (which kernel wins there now)
REPLAYSSM_AOT_DIR=/tmp/aot-sep PYTHONPATH=$PWD:/tmp/site timeout 90 python3 benchmarks/bench_gdn.py --batches none \
  --shapes qwen122b --states f32 --no-fla --min-pool-bytes 3e8 --tiling-sweep qwen122b:1:16:f32+e4m3,qwen122b:8:16:f32+e4m3 \
  --out $R/sweep > $R/sweep.txt 2>&1; echo "== sweep rc=$? at $(elapsed)"; pack
grep -hE "^\(" $R/main-1.txt $R/branch-1.txt | cut -c1-200
