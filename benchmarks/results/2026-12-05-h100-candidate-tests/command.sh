# .device/suites.sh (sourced)
# Sourced by run_a.sh, run_b.sh and run_c.sh on the device, from the tree's root, with the
# bundle in .device/ (docs/integrations-vllm-pages.md): unpacks the candidate and main (cand-/base-src and
# -aot tarballs) once; `suite NAME SECONDS ARGS...` runs GPU tests on the candidate, the whole
# output in $OUT/NAME.txt; `rerun_on_main SECONDS` reruns every failed id of $OUT/*.txt on
# main's tree (modules its tarball lacks JIT-compile there) into $OUT/main-rerun.txt.
set -u
D=$PWD/.device
source $D/prelude.sh || exit 1
export PYTHONUNBUFFERED=1 REPLAYSSM_MAX_JOBS=16
T0=$(date +%s)
unpack() {
  mkdir -p /tmp/$1 /tmp/aot-$1
  [ -f /tmp/$1/.ok ] && return
  tar xJf $D/$1-src.tar.xz -C /tmp/$1 && tar xJf $D/$1-aot.tar.xz -C /tmp/aot-$1 && touch /tmp/$1/.ok
}
unpack cand
unpack base
summary() { grep -E '[0-9]+ (passed|failed)' $1 | tail -1; }
suite() {
  local name=$1 t=$2
  shift 2
  (cd /tmp/cand && PYTHONPATH=/tmp/cand:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-cand \
     timeout -s INT -k 20 $t python3 -m pytest -p no:cacheprovider -m gpu -rfE -q "$@" > $OUT/$name.txt 2>&1
   echo "rc=$?" >> $OUT/$name.txt)
  echo "== $name at $(( $(date +%s) - T0 )) s: $(summary $OUT/$name.txt)"
}
rerun_on_main() {
  local t=$1
  grep -h "^FAILED " $OUT/*.txt 2>/dev/null | sed 's/^FAILED \([^ ]*\).*/\1/' | sort -u \
    | head -40 > /tmp/failed.txt
  [ -s /tmp/failed.txt ] || { echo "== nothing failed"; return; }
  (cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-base \
     timeout -s INT -k 20 $t python3 -m pytest -p no:cacheprovider -m gpu -rfE -q $(cat /tmp/failed.txt) \
       > $OUT/main-rerun.txt 2>&1
   echo "rc=$?" >> $OUT/main-rerun.txt)
  echo "== main rerun at $(( $(date +%s) - T0 )) s: $(summary $OUT/main-rerun.txt)"
}

# .device/run_one.sh: the call (bash .device/run_one.sh, kind nvidia-h100-x1, carry .device)
# One GPU call (the budget left allows about one): the candidate's page tests, the verify suite
# and the family suites with 4 workers (expandable segments against fragmentation), every
# failure's message kept (-rfE) under $OUT.
source .device/suites.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee $OUT/device.txt
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
N=2; [ "$MIB" -gt 100000 ] && N=4  # an H100's 80 GB holds two of the largest oracles at once
suite paged 40 tests/ops/test_paged_slots.py tests/protocol/test_flush_mask_gpu.py -n 2
suite verify 140 tests/protocol/test_verify_gpu.py -n $N
suite families 220 tests/mamba2/test_mamba2_gpu.py tests/gdn/test_gdn_gpu.py tests/kda/test_kda_gpu.py tests/protocol/test_sr_twin_gpu.py tests/protocol/test_materialize_states.py tests/protocol/test_seed_tensor_gpu.py -n $N
