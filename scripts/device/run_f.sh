# GPU call F (one call, about 550 s): branch nan-containment (tree "nan", the kernels' NaN fix):
# its NaN/inf containment tests (expected to pass there), formats tests and the verify suite's
# tree, 200-step and graph tests; its verify timed beside main's (zero-weight records skipped:
# registers equal or fewer, the time must not move); FlashInfer's checkpointing_ssu verify in
# the same call where the bundle carries its modules; then run_g.sh's records-kernel samples.
source scripts/device/suites.sh
suite nan nan 50 tests/protocol/test_verify_nan.py -n 2
suite nan verify-formats 45 tests/protocol/test_verify_formats_gpu.py -n 2
suite nan verify 100 tests/protocol/test_verify_gpu.py -n 3 -k "trees or 200_steps or graph"
for tree in nan main; do
  in_tree $tree timeout 80 python3 benchmarks/bench_verify.py --shapes super120b,qwen122b --batches 1,8,256 \
    --ts 4,8 --min-pool-bytes 6e8 --no-fla --out $OUT/verify-$tree > $OUT/bench-verify-$tree.txt 2>&1
  echo "== $tree verify bench at $(elapsed)"; tail -4 $OUT/bench-verify-$tree.txt
done
# (.device/fi-aot: anchor_lp_spec.py --precompile on the CPU machine, the FP32 T = 2, 4, 8
# super120b modules; .device/anchors: the anchor scripts; unbuilt modules fail fast, JIT off)
if [ -d .device/fi-aot ] && [ -f .device/anchors/anchor_lp_spec.py ]; then
  mkdir -p $OUT/fi
  FLASHINFER_DISABLE_JIT=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 timeout 120 python3 .device/anchors/anchor_lp_spec.py \
    --aot-dir .device/fi-aot --skip lp,tune --spec-batches 256,8,1 --spec-ts 4,8 --out $OUT/fi > $OUT/fi.txt 2>&1
  echo "== FlashInfer verify at $(elapsed)"; tail -4 $OUT/fi.txt
fi
RECORDS_ONLY=1 bash scripts/device/run_g.sh
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
