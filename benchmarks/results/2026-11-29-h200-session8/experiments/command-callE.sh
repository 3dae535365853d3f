#!/usr/bin/env bash
# Session 8, call E (experiment, wip/state-smem-floor f8f7af6, snapE/aotE: the 4 GDN L = 16
# bf16-activation modules, built here for sm_90a): a floor on the split state CTAs' shared memory
# (REPLAYSSM_EXP_STATE_SMEM_KB) at qwen4b and qwen122b, batch 8 and 256, FP32 and BF16
# checkpoints. Call N: BF16 checkpoints ran faster at batch 256 (slower at batch 8) with a state
# CTA of 19 KB instead of 10 KB. Also one preferred carve-out for both kernels (REPLAYSSM_EXP_CARVEOUT), and
# 2-warp records CTAs (REPLAYSSM_EXP_RECORDS_WARPS2=1).
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
[ -d /tmp/aotE ] || { mkdir -p /tmp/aotE && tar xJf $D/aotE.tar.xz -C /tmp/aotE --strip-components=1; }
R=$OUT/run; mkdir -p $R
export DEVICE_DIR=$D
cd $D/snapE
export REPLAYSSM_AOT_DIR=/tmp/aotE REPLAYSSM_GIT_COMMIT=$(cat .commit) REPLAYSSM_DISABLE_JIT=1
for v in 0:-:0 16:-:0 32:-:0 48:-:0; do
  IFS=: read kb co w2 <<< "$v"
  if [ "$co" = - ]; then unset REPLAYSSM_EXP_CARVEOUT; else export REPLAYSSM_EXP_CARVEOUT=$co; fi
  t=smem$kb-co$co-w2$w2
  REPLAYSSM_EXP_RECORDS_WARPS2=$w2 REPLAYSSM_EXP_STATE_SMEM_KB=$kb GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,256 --windows 16 --window-sweep 16 --states f32,bf16 --shapes qwen4b,qwen122b" \
    OUT=$R/$t timeout 70 bash benchmarks/h200_run.sh bench-gdn > $R/$t.out 2>&1
  grep -E "\('qwen" $R/$t.out | sed "s/^/$v /" | cut -c1-260
done
cd $OUT && tar czf run.tgz run && rm -rf run
