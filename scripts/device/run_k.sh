# GPU call K (issue 39; not yet run; about 300 s): branch verify-r64-regs (tree "r64"): Mamba-2's
# per-item verify at 64 state values a lane asks for 4 CTAs per SM (128 registers at
# -Xptxas -v) instead of taking 168 (3 CTAs). Its verify tests, then the verify at batches 4 and 8
# (where the policy runs that tile) beside main's in the same call. The bundle's r64-aot holds the
# Mamba-2 modules only (the change is Mamba-2's), so its tests are Mamba-2's. FP32 inputs at T = 8
# spill at that cap (16 local loads, 12 stores in the SASS); BF16 inputs and T <= 4 do not.
source scripts/device/suites.sh
suite r64 verify 150 tests/protocol/test_verify_gpu.py -n 4 -k "(verify_kernels or trees or 200_steps) and (super120b or nano4b)"
suite r64 verify-formats 50 tests/protocol/test_verify_formats_gpu.py -n 3 -k mamba2
BENCH="python3 /tmp/r64/benchmarks/bench_verify.py --no-baselines --verify-kernels= --no-fla --min-pool-bytes 6e8"
for tree in r64 main; do
  in_tree $tree timeout 90 $BENCH --shapes super120b,nano4b --batches 8,4 --ts 4,8 --out $OUT/small-$tree \
    > $OUT/small-$tree.txt 2>&1
  echo "== $tree at $(elapsed)"; grep b= $OUT/small-$tree.txt
done
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
