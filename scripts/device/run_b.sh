# GPU call B: branch verify-formats-on-candidate (the combo tree): the verify on e4m3 / NVFP4
# checkpoints and read copies, the verify suite, then its FP32 verify timed beside main's.
source scripts/device/suites.sh
suite combo verify-formats 150 tests/protocol/test_verify_formats_gpu.py -n 2
suite combo verify 200 tests/protocol/test_verify_gpu.py -n 2
for tree in combo main; do
  in_tree $tree timeout 100 python3 benchmarks/bench_verify.py --shapes super120b --batches 1,8,256 \
    --ts 4,8 --verify-kernels split,per-item --min-pool-bytes 6e8 --no-fla --out $OUT/verify-$tree \
    > $OUT/bench-verify-$tree.txt 2>&1
  echo "== $tree verify bench at $(elapsed)"; tail -3 $OUT/bench-verify-$tree.txt
done
