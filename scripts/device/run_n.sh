# GPU call N (issue 39 item 6, part 2 of the grand run; about 500 s): every model shape at batch
# 64, 8 and 1, T = 2, 4, 8 (as run_m.sh), then FlashInfer's checkpointing_ssu verify (default
# and monolith, mixed acceptance) at every batch and T for super120b, the one model shape its
# kernel compiles for (nano4b's head dim 80 fails its static asserts).
source scripts/device/suites.sh
BENCH="python3 benchmarks/bench_verify.py --verify-kernels= --min-pool-bytes 6e8"
for shape in super120b nano4b qwen4b qwen122b kimi48b; do
  in_tree main timeout 75 $BENCH --shapes $shape --batches 64,8,1 --ts 2,4,8 --out $OUT/small-$shape \
    > $OUT/small-$shape.txt 2>&1
  echo "== $shape at $(elapsed)"; grep -E "b=|Error" $OUT/small-$shape.txt | cut -c1-400
done
mkdir -p $OUT/fi
FLASHINFER_DISABLE_JIT=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 timeout 120 python3 .device/anchors/anchor_lp_spec.py \
  --aot-dir .device/fi-aot --skip lp,tune --spec-batches 256,64,8,1 --spec-ts 2,4,8 --out $OUT/fi > $OUT/fi.txt 2>&1
echo "== FlashInfer verify at $(elapsed)"; grep -E "monolith.*mixed|auto.*mixed" $OUT/fi.txt | head -30
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
