# GPU call M (issue 39 item 6, part 1 of the grand run; about 560 s): every model shape at batch
# 256, T = 2, 4, 8: our verify (mixed and paper acceptance), T = 1 step, tree verify, snapshot
# baseline and fla's GDN and KDA forms. Part 2 is run_n.sh on the same machine.
source scripts/device/suites.sh
BENCH="python3 benchmarks/bench_verify.py --verify-kernels= --min-pool-bytes 6e8"
for shape in super120b nano4b qwen4b qwen122b kimi48b; do
  in_tree main timeout 110 $BENCH --shapes $shape --batches 256 --ts 2,4,8 --out $OUT/b256-$shape \
    > $OUT/b256-$shape.txt 2>&1
  echo "== $shape at $(elapsed)"; grep -E "b=|Error" $OUT/b256-$shape.txt | cut -c1-400
done
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
