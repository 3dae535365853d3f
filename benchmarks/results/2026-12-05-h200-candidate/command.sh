# Device call 2: the candidate's verify suite, two benchmarks, then the family / SR / materialize GPU suites.
set -u
D=$PWD/.device
source $D/prelude.sh
export PYTHONUNBUFFERED=1 REPLAYSSM_MAX_JOBS=16
LOG=$OUT/run2.log
mkdir -p /tmp/cand /tmp/aot-cand
tar xJf $D/cand-src.tar.xz -C /tmp/cand; tar xJf $D/cand-aot.tar.xz -C /tmp/aot-cand
cd /tmp/cand && export PYTHONPATH=/tmp/cand:/tmp/site REPLAYSSM_AOT_DIR=/tmp/aot-cand
t0=$(date +%s)
run() { local t=$1 f=$2; shift 2; echo "== $* ($(( $(date +%s) - t0 )) s)" | tee -a $LOG
  timeout $t python3 -m pytest -p no:cacheprovider -m gpu -v -rfE "$@" > $f 2>&1; echo "rc=$?" | tee -a $LOG
  echo "PASSED $(grep -c ' PASSED' $f) FAILED $(grep -c ' FAILED' $f) ERROR $(grep -c ' ERROR' $f)" | tee -a $LOG
  grep -E "^(FAILED|ERROR) |[0-9]+ passed" $f | tail -20 | tee -a $LOG; }
run 200 /tmp/verify.txt tests/protocol/test_verify_gpu.py -n 4
echo "== benches ($(( $(date +%s) - t0 )) s)" | tee -a $LOG
timeout 60 python3 benchmarks/bench_verify.py --shapes super120b --batches 256 --ts 4,8 --verify-kernels split --min-pool-bytes 6e8 --no-fla --out $OUT/bv 2>&1 | tail -8 | tee -a $LOG
timeout 45 python3 benchmarks/bench_mamba2.py --shapes super120b --batches 256 --windows 16 --window-sweep 16 --states bf16,bf16sr --out $OUT/bm 2>&1 | tail -8 | tee -a $LOG
left=$(( 545 - ($(date +%s) - t0) ))
run $left /tmp/fam.txt tests/mamba2/test_mamba2_gpu.py tests/gdn/test_gdn_gpu.py tests/kda/test_kda_gpu.py tests/protocol/test_sr_twin_gpu.py tests/protocol/test_seed_tensor_gpu.py tests/protocol/test_materialize_states.py -n 6
grep -E " (FAILED|ERROR)" /tmp/fam.txt /tmp/verify.txt | head -40 > $OUT/failures.txt
echo "end $(( $(date +%s) - t0 )) s" | tee -a $LOG
