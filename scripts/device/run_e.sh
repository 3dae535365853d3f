# GPU call E: branch verify-formats-on-candidate (the combo tree) after its tree-commit fix: the
# verify on e4m3 / NVFP4 / BF16 checkpoints and read copies, then the NaN/inf containment tests.
source scripts/device/suites.sh
suite combo verify-formats 45 tests/protocol/test_verify_formats_gpu.py -n 2
suite combo nan 45 tests/protocol/test_verify_nan.py -n 2
