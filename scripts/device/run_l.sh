# GPU call L (issue 39; about 400 s): main's verify kernels since the held-records helper and the
# 4-CTA 64-value Mamba-2 tile: the verify suite's kernel, tree, 200-step and graph tests, the NaN
# containment tests and the checkpoint-format tests; then memcheck and racecheck over every
# verify and snapshot config (scripts/sanitize.sh with SANITIZE_OPS; modules from
# .device/san-aot.tar.xz: the sanitizer preset's verify and snapshot specs, built with
# REPLAYSSM_JIT_DEBUG=1 as scripts/sanitize.sh says).
source scripts/device/suites.sh
suite main verify 120 tests/protocol/test_verify_gpu.py -n 4 -k "verify_kernels or trees or 200_steps or graph"
suite main nan 50 tests/protocol/test_verify_nan.py -n 3
suite main verify-formats 45 tests/protocol/test_verify_formats_gpu.py -n 3
mkdir -p /tmp/aot-san && tar xJf .device/san-aot.tar.xz -C /tmp/aot-san
(cd /tmp/main && SANITIZE_OPS="verify snapshot" REPLAYSSM_AOT_DIR=/tmp/aot-san MEMCHECK_LIMIT=100 RACECHECK_LIMIT=70 \
  DEVICE_DIR=$D bash scripts/sanitize.sh memcheck racecheck > $OUT/sanitizer.txt 2>&1)
echo "== sanitizer at $(elapsed)"; tail -3 $OUT/sanitizer.txt
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
