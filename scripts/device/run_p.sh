# GPU call P (issue 39; about 150 s): whether another verify launch beats the policy where the
# grand run (run_m.sh) shows the largest gaps: Kimi-Linear at T = 4 and 8 under 16- and 32-row
# tiles, and the GDN shapes at batches 8 and 64 under the per-item kernel and a 32-row tile.
source scripts/device/suites.sh
BENCH="python3 benchmarks/bench_verify.py --no-baselines --verify-kernels= --min-pool-bytes 6e8"
in_tree main timeout 100 $BENCH --shapes kimi48b --batches 256,64,8 --ts 4,8 \
  --verify-launches "r16=verify_rows_per_cta=16;r32=verify_rows_per_cta=32" --out $OUT/kda-tiles > $OUT/kda-tiles.txt 2>&1
echo "== kimi48b at $(elapsed)"; grep b= $OUT/kda-tiles.txt
in_tree main timeout 80 $BENCH --shapes qwen4b,qwen122b --batches 64,8 --ts 4,8 \
  --verify-launches "per_item=verify_kernel=per-item;r32=verify_rows_per_cta=32" --out $OUT/gdn-launches > $OUT/gdn-launches.txt 2>&1
echo "== gdn at $(elapsed)"; grep b= $OUT/gdn-launches.txt
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
