# GPU call AC (issue 40, small batches): (1) the gdn-separate-tile branch's GPU test (its 32-row
# per-item tile at qwen122b batch 1 against the float64 reference); (2) A/B at batches 1 and 8 of
# main (a-src, grand-aot) against the early-arrival tree (ea-src, ea-grand-aot: per-item CTAs
# count their arrival past the first barrier instead of at the end), A B, then B A after (3) if time is left; (3) the early-arrival
# tree's per-item, flush-every-step and switching GPU tests (ea-tests-aot). Output: $OUT/run.tgz.
set -u
source .device/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True REPLAYSSM_DISABLE_JIT=1
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
R=/tmp/run; mkdir -p $R /tmp/a /tmp/b /tmp/aot-sep /tmp/aot-a /tmp/aot-b /tmp/aot-bt
pack() { tar czf $OUT/run.tgz -C $R .; }
nvidia-smi --query-gpu=name --format=csv,noheader > $R/device.txt
tar xJf .device/sep-aot.tar.xz -C /tmp/aot-sep
REPLAYSSM_AOT_DIR=/tmp/aot-sep PYTHONPATH=$PWD:/tmp/site timeout -s INT -k 10 100 python3 -m pytest -p no:cacheprovider \
  -m gpu -rfE -q "tests/protocol/test_checkpoint_formats_steps.py::test_gdn_separate_per_item_carried_copy_on_the_policys_small_batch_tile" \
  > $R/tile-test.txt 2>&1
echo "== tile test rc=$? at $(elapsed): $(tail -1 $R/tile-test.txt)"; pack
tar xJf .device/a-src.tar.xz -C /tmp/a; tar xJf .device/ea-src.tar.xz -C /tmp/b
tar xJf .device/grand-aot.tar.xz -C /tmp/aot-a; tar xzf .device/ea-grand-aot.tar.gz -C /tmp/aot-b
bench() {  # tree round
  (cd /tmp/$1 && PYTHONPATH=/tmp/$1:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-$1 timeout 75 python3 benchmarks/bench_mamba2.py \
    --shapes super120b --batches 1,8 --window-sweep 16 --min-pool-bytes 3e8 --states f32,bf16,bf16sr,e4m3,f32+e4m3 \
    --out $R/$1-$2-mamba2 > $R/$1-$2-mamba2.txt 2>&1)
  echo "== $1 round $2 mamba2 rc=$? at $(elapsed)"
  (cd /tmp/$1 && PYTHONPATH=/tmp/$1:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-$1 timeout 60 python3 benchmarks/bench_gdn.py \
    --shapes qwen122b,kimi48b --batches 1,8 --window-sweep 16 --min-pool-bytes 3e8 --states f32 --no-fla \
    --out $R/$1-$2-gdn > $R/$1-$2-gdn.txt 2>&1)
  echo "== $1 round $2 gdn rc=$? at $(elapsed)"; pack
}
bench a 1; bench b 1
grep -hE "^\(" $R/*-1-mamba2.txt $R/*-1-gdn.txt | cut -c1-200 | head -40
if [ -f .device/ea-tests-aot.tar.xz ]; then  # (3), where its modules came
tar xJf .device/ea-tests-aot.tar.xz -C /tmp/aot-bt
(cd /tmp/b && PYTHONPATH=/tmp/b:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-bt timeout -s INT -k 10 170 python3 -m pytest -p no:cacheprovider \
  -m gpu -rfE -q tests/mamba2/test_mamba2_gpu.py tests/gdn/test_gdn_gpu.py tests/kda/test_kda_gpu.py \
  -k "per-item or per_item or flush_every or switching or sixteen or stochastic or graph or pad_slot or bad_input" > $R/ea-tests.txt 2>&1)
echo "== ea tests rc=$? at $(elapsed): $(tail -1 $R/ea-tests.txt)"; pack
fi
# (4) Every launch variant at batch 1 on the early-arrival tree: the per-item tile rule.
(cd /tmp/b && PYTHONPATH=/tmp/b:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-b timeout 90 python3 benchmarks/bench_mamba2.py \
  --batches none --shapes super120b --states e4m3 --window-sweep 16 --min-pool-bytes 3e8 \
  --tiling-sweep super120b:1:16:e4m3,super120b:1:16:f32+e4m3,super120b:1:16:bf16sr --out $R/b-sweep > $R/b-sweep.txt 2>&1)
echo "== b sweep rc=$? at $(elapsed)"; pack
# A second round, B then A, where the limit leaves time for it.
if [ $(( $(date +%s) - T0 )) -lt 420 ]; then bench b 2; bench a 2; fi
