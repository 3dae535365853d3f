# GPU call C: this branch's timings beside main's, both trees in one call (main's benchmark
# modules JIT-compile where its tarball lacks them): verify at super120b B = 256, and the BF16
# checkpoint with and without stochastic rounding (sr-nonflush).
source scripts/device/suites.sh
for tree in cand base; do
  (cd /tmp/$tree && export PYTHONPATH=/tmp/$tree:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-$tree
   timeout 200 python3 benchmarks/bench_verify.py --shapes super120b --batches 256 --ts 4,8 \
     --verify-kernels split --min-pool-bytes 6e8 --no-fla --out $OUT/verify-$tree
   timeout 80 python3 benchmarks/bench_mamba2.py --shapes super120b --batches 256 --windows 16 \
     --window-sweep 16 --states bf16,bf16sr --out $OUT/mamba2-$tree) > $OUT/bench-$tree.txt 2>&1
  echo "== $tree at $(( $(date +%s) - T0 )) s"
  tail -4 $OUT/bench-$tree.txt
done
