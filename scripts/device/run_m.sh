# GPU call M (issue 39 item 6, the grand verify run; about 450 s, one call): FlashInfer's
# checkpointing_ssu verify (default "auto" and monolith, mixed acceptance) at batch 256, 64, 8 and
# 1, T = 2, 4, 8, for super120b, the one model shape its kernel compiles for (nano4b's head dim
# 80 fails its static asserts at every T); then every model shape at the same batches and T: our
# verify (mixed and paper acceptance), our T = 1 step, tree verify (T = 8), the snapshot
# baseline and fla's GDN and KDA forms. Largest batch first; each (shape, batch) group has a time
# limit and writes its JSON per config, so a cut-short call keeps what it measured.
source scripts/device/suites.sh
mkdir -p $OUT/fi
FLASHINFER_DISABLE_JIT=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 timeout 120 python3 .device/anchors/anchor_lp_spec.py \
  --aot-dir .device/fi-aot --skip lp,tune --spec-batches 256,64,8,1 --spec-ts 2,4,8 --out $OUT/fi > $OUT/fi.txt 2>&1
echo "== FlashInfer verify at $(elapsed)"; grep -E "monolith.*mixed|auto.*mixed" $OUT/fi.txt | head -30 | cut -c1-160
BENCH="python3 benchmarks/bench_verify.py --verify-kernels= --min-pool-bytes 6e8"
for batch in 256 64 8 1; do
  for shape in super120b nano4b qwen4b qwen122b kimi48b; do
    in_tree main timeout 90 $BENCH --shapes $shape --batches $batch --ts 2,4,8 --out $OUT/b$batch-$shape \
      > $OUT/b$batch-$shape.txt 2>&1
    echo "== $shape b=$batch at $(elapsed)"; grep -E "b=|Error" $OUT/b$batch-$shape.txt | cut -c1-300
  done
done
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
