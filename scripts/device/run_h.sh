# GPU call H (issue 39; one call, about 450 s): branch verify-latency (tree "vl": nan-containment
# with its KDA fix, ring loads before the cursor read in the per-item verify at small batches,
# programmatic verify launches, the split records kernel's x rows sent to L2 early, the shared
# draft rows written by the CTAs that hold them). Build its modules with PYTHONPATH=<the tree>.
# Its NaN, formats and verify kernel tests; then its verify at B = 1 and 8 under the new flags and
# with each turned off (--verify-launches), beside main's; B = 256 beside main's; FlashInfer.
source scripts/device/suites.sh
suite vl nan 60 tests/protocol/test_verify_nan.py -n 3
suite vl verify-formats 50 tests/protocol/test_verify_formats_gpu.py -n 3
suite vl verify 180 tests/protocol/test_verify_gpu.py -n 4 -k "verify_kernels or trees or 200_steps or graph"
BENCH="python3 /tmp/vl/benchmarks/bench_verify.py --no-baselines --verify-kernels= --no-fla --min-pool-bytes 6e8"
OFF="plain=speculative_records=false,overlap_prior_kernel=false;noearly=speculative_records=false;nooverlap=overlap_prior_kernel=false;r16=verify_rows_per_cta=16;r32=verify_rows_per_cta=32;r64=verify_rows_per_cta=64"
in_tree vl timeout 100 $BENCH --shapes super120b,qwen122b,kimi48b --batches 1,8 --ts 4,8 --verify-launches "$OFF" \
  --out $OUT/small-vl > $OUT/small-vl.txt 2>&1
echo "== vl small batches at $(elapsed)"; cat $OUT/small-vl.txt | grep b=
in_tree main timeout 80 $BENCH --shapes super120b,qwen122b --batches 1,8 --ts 4,8 --out $OUT/small-main > $OUT/small-main.txt 2>&1
echo "== main small batches at $(elapsed)"; cat $OUT/small-main.txt | grep b=
for tree in vl main; do
  in_tree $tree timeout 70 $BENCH --shapes super120b --batches 256 --ts 4,8 --out $OUT/large-$tree > $OUT/large-$tree.txt 2>&1
  echo "== $tree B = 256 at $(elapsed)"; grep b= $OUT/large-$tree.txt
done
if [ -d .device/fi-aot ] && [ -f .device/anchors/anchor_lp_spec.py ]; then
  mkdir -p $OUT/fi
  FLASHINFER_DISABLE_JIT=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 timeout 60 python3 .device/anchors/anchor_lp_spec.py \
    --aot-dir .device/fi-aot --skip lp,tune --spec-batches 8,1 --spec-ts 4,8 --out $OUT/fi > $OUT/fi.txt 2>&1
  echo "== FlashInfer verify at $(elapsed)"; grep -E "monolith.*mixed|auto.*mixed" $OUT/fi.txt
fi
# The per-item verify's duration at B = 1, T = 4 (super120b), without the graph around it.
in_tree vl timeout 40 ncu --clock-control none --kernel-name-base demangled -k 'regex:mamba2::Verify<' --launch-skip 2 -c 1 \
  --section SpeedOfLight --section LaunchStats --section Occupancy python3 /tmp/vl/benchmarks/bench_verify.py \
  --no-baselines --verify-kernels= --no-fla --shapes super120b --batches 1 --ts 4 --reps 1 --rounds 1 --cycle-steps 1 \
  --min-pool-bytes 6e8 --out /tmp/ncu-out > $OUT/b1-verify-details.txt 2>&1
echo "== ncu B = 1 at $(elapsed)"; grep -E "Duration|Registers Per|Achieved Occupancy" $OUT/b1-verify-details.txt
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
