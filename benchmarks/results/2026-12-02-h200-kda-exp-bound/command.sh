#!/usr/bin/env bash
# Session 17 call 5: an upper bound on what premultiplied keys could save in KDA's split step:
# the same step with every per-channel decay exp replaced by an FMA (wrong values, same bytes).
set -uo pipefail
source .device/prelude.sh || exit 1
R=/tmp/res; mkdir -p $R
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; tar czf $OUT/res.tgz -C $R . 2>/dev/null; }
export PYTHONUNBUFFERED=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
SPEC=kda:head_k_dim=128,head_v_dim=128,value_heads_per_key_head=1,window=16,act_dtype=bf16,state_dtype=f32
rm -rf /tmp/noexp && mkdir -p /tmp/noexp && cp -r replayssm_jit templates benchmarks tests /tmp/noexp/
python3 - <<'PY'
p = "/tmp/noexp/templates/gdn/decode_kernel.cuh"
s = open(p).read()
old = "    column[i * STRIDE] = expf(suffix);"
assert old in s
open(p, "w").write(s.replace(old, "    column[i * STRIDE] = fmaf(suffix, 1e-3f, 1.f);  // bound: no exp"))
PY
(PYTHONPATH=$PWD:$PYTHONPATH REPLAYSSM_CACHE_DIR=/tmp/rc1 python3 -m replayssm_jit aot --out /tmp/aot1 --jobs 8 --spec $SPEC > $R/aot1.log 2>&1 &
 cd /tmp/noexp && PYTHONPATH=/tmp/noexp:$PYTHONPATH REPLAYSSM_CACHE_DIR=/tmp/rc2 python3 -m replayssm_jit aot --out /tmp/aot2 --jobs 8 --spec $SPEC > $R/aot2.log 2>&1 & wait); el built
for round in 1; do
  PYTHONPATH=$PWD:$PYTHONPATH REPLAYSSM_AOT_DIR=/tmp/aot1 REPLAYSSM_CACHE_DIR=/tmp/rc1 timeout 40 python3 benchmarks/bench_gdn.py --shapes kimi48b --batches 256 --states f32 --no-fla --reps 6 --out $R/main$round > $R/main$round.log 2>&1; grep -E "kimi|replay|amort" $R/main$round.log | tail -4
  (cd /tmp/noexp && PYTHONPATH=/tmp/noexp:$PYTHONPATH REPLAYSSM_AOT_DIR=/tmp/aot2 REPLAYSSM_CACHE_DIR=/tmp/rc2 timeout 40 python3 benchmarks/bench_gdn.py --shapes kimi48b --batches 256 --states f32 --no-fla --reps 6 --out $R/noexp$round > $R/noexp$round.log 2>&1); grep -E "kimi|replay|amort" $R/noexp$round.log | tail -4
  el round$round
done
