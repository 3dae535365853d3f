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
# FlashInfer's checkpointing_ssu verify in the same call (issue 39's peer), where the bundle has
# its modules (.device/fi-aot: anchor_lp_spec.py --precompile on the CPU machine, the f32 T = 2,
# 4, 8 super120b modules) and the anchor scripts (.device/anchors); other modules are not built and
# fail fast with JIT disabled.
if [ -d .device/fi-aot ] && [ -f .device/anchors/anchor_lp_spec.py ]; then
  mkdir -p $OUT/fi
  FLASHINFER_DISABLE_JIT=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 timeout 150 python3 .device/anchors/anchor_lp_spec.py \
    --aot-dir .device/fi-aot --skip lp,tune --spec-batches 256,8,1 --spec-ts 4,8 --out $OUT/fi > $OUT/fi.txt 2>&1
  echo "== FlashInfer verify at $(elapsed)"; tail -4 $OUT/fi.txt
fi
