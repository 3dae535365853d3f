# GPU call A: what main's paged kernels have not yet run on a GPU (benchmarks/results/
# 2026-12-05-h100-candidate-tests): the largest chained verify case one test at a time, the
# flush-mask, materialize and seed-tensor files with two workers, the verify autotune's timer,
# then the Mamba-2 step at batches 1 to 64 on main and on the tree before the slot strides (old),
# in one call (about 600 s: the largest verify case alone may need a call of its own).
source scripts/device/suites.sh
suite main verify-largest 170 tests/protocol/test_verify_gpu.py -k "test_verify_chain_fused_commit and 256-16-8"
suite main flush-mask 110 tests/protocol/test_flush_mask_gpu.py -n 2
suite main materialize 80 tests/protocol/test_materialize_states.py tests/protocol/test_seed_tensor_gpu.py -n 2
suite main autotune 90 tests/launch/test_autotune.py tests/launch/test_autotune_verify.py
for tree in main old; do
  in_tree $tree timeout 60 python3 benchmarks/bench_mamba2.py --shapes super120b --batches 1,8,64 \
    --windows 16 --window-sweep 16 --window-sweep-batch 64 --states f32 --out $OUT/mamba2-$tree > $OUT/bench-$tree.txt 2>&1
  echo "== $tree bench at $(elapsed)"; tail -3 $OUT/bench-$tree.txt
done
