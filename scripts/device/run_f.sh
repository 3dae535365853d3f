# GPU call F: branch nan-containment (tree "nan"): the NaN/inf containment tests (expected to pass
# there), the verify suite, then the verify timed beside main's (its draft loops skip zero-weight
# records: registers equal or fewer, the time must not move).
source scripts/device/suites.sh
suite nan nan 60 tests/protocol/test_verify_nan.py -n 2
suite nan verify-formats 60 tests/protocol/test_verify_formats_gpu.py -n 2
suite nan verify 240 tests/protocol/test_verify_gpu.py -n 3
for tree in nan main; do
  in_tree $tree timeout 90 python3 benchmarks/bench_verify.py --shapes super120b,qwen122b --batches 1,8,256 \
    --ts 4,8 --min-pool-bytes 6e8 --no-fla --out $OUT/verify-$tree > $OUT/bench-verify-$tree.txt 2>&1
  echo "== $tree verify bench at $(elapsed)"; tail -4 $OUT/bench-verify-$tree.txt
done
