# GPU call I (issue 39, about 120 s): tree "vl" (as run_h.sh) at the small-batch shapes run_h.sh's
# time limit cut: super120b B = 8, qwen122b B = 1 and 8, kimi48b B = 1, T = 4, with the 32-row
# tile beside the policy's; main's verify in the same call.
source scripts/device/suites.sh
BENCH="python3 /tmp/vl/benchmarks/bench_verify.py --no-baselines --verify-kernels= --no-fla --min-pool-bytes 6e8 --ts 4"
in_tree vl timeout 75 $BENCH --shapes super120b,qwen122b --batches 8 --verify-launches "r32=verify_rows_per_cta=32" \
  --out $OUT/b8-vl > $OUT/b8-vl.txt 2>&1
echo "== vl B = 8 at $(elapsed)"; grep b= $OUT/b8-vl.txt
in_tree vl timeout 45 $BENCH --shapes qwen122b,kimi48b --batches 1 --verify-launches "r32=verify_rows_per_cta=32" \
  --out $OUT/b1-vl > $OUT/b1-vl.txt 2>&1
echo "== vl B = 1 at $(elapsed)"; grep b= $OUT/b1-vl.txt
in_tree main timeout 40 $BENCH --shapes super120b,qwen122b --batches 8 --out $OUT/b8-main > $OUT/b8-main.txt 2>&1
echo "== main B = 8 at $(elapsed)"; grep b= $OUT/b8-main.txt
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
