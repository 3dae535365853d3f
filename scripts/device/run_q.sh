# GPU call Q (issue 39; about 90 s): the split verify's state tile halved under
# VERIFY_SPLIT_STATE_MIN_CTAS_PER_SM (launch/policy.py) against the split step's tile (64 rows),
# GDN at batches 4, 8 and 16, T = 2, 4, 8, in one process.
source scripts/device/suites.sh
in_tree main timeout 120 python3 benchmarks/bench_verify.py --no-baselines --verify-kernels= --min-pool-bytes 6e8 \
  --shapes qwen4b,qwen122b --batches 16,8,4 --ts 2,4,8 --verify-launches "r64=verify_rows_per_cta=64" \
  --out $OUT/gdn-state-tile > $OUT/gdn-state-tile.txt 2>&1
echo "== gdn at $(elapsed)"; grep b= $OUT/gdn-state-tile.txt
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
