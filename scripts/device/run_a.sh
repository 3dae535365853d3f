# GPU call A of the paged-candidate run: the page, flush-mask and materialize kernels, then the
# Mamba-2 and GDN suites with two workers (memory: the float64 oracles of the largest cases).
source scripts/device/suites.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee $OUT/device.txt
suite paged 60 tests/ops/test_paged_slots.py
suite flush-mask 120 tests/protocol/test_flush_mask_gpu.py
suite materialize 60 tests/protocol/test_materialize_states.py tests/protocol/test_seed_tensor_gpu.py
suite mamba2 150 tests/mamba2/test_mamba2_gpu.py -n 2
suite gdn 150 tests/gdn/test_gdn_gpu.py -n 2
