# ---- call R (.device/call_r.sh) ----
#!/usr/bin/env bash
# Call R: A (93097a7, last session's final kernels) against B (narrow state rows) side by side at
# batch 256, per-kernel profiles of both, then B's full GPU suite.
D=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1
for v in A B; do
  s=$D/snap; a=$D/aot.tar.xz; [ $v = B ] && s=$D/snapB && a=$D/aotB.tar.xz
  rm -rf /tmp/aot$v && mkdir -p /tmp/aot$v && tar xJf $a -C /tmp/aot$v --strip-components=1
  cp $D/snapB/benchmarks/profile_steps.py $s/benchmarks/ 2>/dev/null
done
R=$OUT/run; mkdir -p $R
run() {  # run VARIANT NAME TIMEOUT what [ENV=...]
  v=$1; n=$2; t=$3; w=$4; shift 4
  s=$D/snap; [ $v = B ] && s=$D/snapB
  (cd $s && env "$@" DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aot$v REPLAYSSM_GIT_COMMIT=$(cd $s && cat .commit) OUT=$R/$v-$n \
     timeout $t bash benchmarks/h200_run.sh $w > $R/$v-$n.out 2>&1)
  grep -E "\('(super|nano|qwen)" $R/$v-$n.out | sed "s/^/$v-$n /" | cut -c1-330
}
M="--reps 10 --batches 256 --windows 16 --window-sweep 16 --states f32 --shapes super120b,nano4b"
G="--reps 10 --no-fla --batches 256 --windows 16 --window-sweep 16 --states f32 --shapes qwen4b,qwen122b"
for v in A B; do
  run $v m2 70 bench-mamba2 BENCH_ARGS="$M"
  run $v m2ns 50 bench-mamba2 BENCH_ARGS="$M" REPLAYSSM_SPECULATIVE_RECORDS=0
  run $v gdn 70 bench-gdn GDN_BENCH_ARGS="$G"
  run $v gdnns 50 bench-gdn GDN_BENCH_ARGS="$G" REPLAYSSM_SPECULATIVE_RECORDS=0
done
run B m2tile 70 bench-mamba2 BENCH_ARGS="--reps 10 --batches none --window-sweep 16 --states f32 --shapes super120b --tiling-sweep super120b:256:16:f32,nano4b:256:16:f32"
run B gdntile 70 bench-gdn GDN_BENCH_ARGS="--reps 10 --no-fla --batches none --window-sweep 16 --states f32 --shapes qwen4b --tiling-sweep qwen4b:256:16:f32,qwen122b:256:16:f32"
source $D/prelude.sh
for v in A B; do
  s=$D/snap; [ $v = B ] && s=$D/snapB
  for f in mamba2:super120b,nano4b gdn:qwen4b,qwen122b; do
    (cd $s && PYTHONPATH=$s REPLAYSSM_AOT_DIR=/tmp/aot$v timeout 40 python3 benchmarks/profile_steps.py --family ${f%%:*} --shapes ${f#*:} --out $R/prof$v) 2>&1 | grep -E "step|Error" | sed "s/^/$v /" | cut -c1-250
  done
done
run B tests 240 tests PYTEST_ARGS="--maxfail=5 --durations=3"
tail -4 $R/B-tests.out
cd $OUT && tar czf run.tgz run && rm -rf run

# ---- call S (.device/call_s.sh) ----
#!/usr/bin/env bash
# Call S: per-kernel times of the split step (torch.profiler, then ncu on one step per phase).
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapS
export PYTHONUNBUFFERED=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=/tmp/aotB
[ -d /tmp/aotB ] || { mkdir -p /tmp/aotB && tar xJf $D/aotB.tar.xz -C /tmp/aotB --strip-components=1; }
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH
R=$OUT/run; mkdir -p $R; cd $S
for f in mamba2:super120b,nano4b gdn:qwen4b,qwen122b; do
  timeout 60 python3 benchmarks/profile_steps.py --family ${f%%:*} --shapes ${f#*:} --out $R 2>&1 | grep -E "step|Error" | cut -c1-250
done
for f in mamba2:super120b gdn:qwen122b; do
  timeout 150 ncu --clock-control none -k regex:per_item_kernel --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats python3 benchmarks/profile_steps.py --single --family ${f%%:*} --shapes ${f#*:} --out $R/ncu > $R/ncu-${f%%:*}.txt 2>&1
  grep -E "per_item_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Waves Per|Stall|Warp Cycles Per Issued" $R/ncu-${f%%:*}.txt | sed -E 's/void replayssm::per_item_kernel<replayssm::([a-z0-9]+)::([A-Za-z]+)<([^>]{0,60}).*/== \1 \2 <\3/' | cut -c1-150
done
cd $OUT && tar czf run.tgz run && rm -rf run

# ---- call T (.device/call_t.sh) ----
#!/usr/bin/env bash
# Call T: C (faster split records kernels) at batch 256 against call R's B, per-kernel profile
# and ncu of the records kernels, then C's full GPU suite.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapC
export PYTHONUNBUFFERED=1
rm -rf /tmp/aotC && mkdir -p /tmp/aotC && tar xJf $D/aotC.tar.xz -C /tmp/aotC --strip-components=1
R=$OUT/run; mkdir -p $R
run() {  # run NAME TIMEOUT what [ENV=...]
  n=$1; t=$2; w=$3; shift 3
  (cd $S && env "$@" DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotC REPLAYSSM_GIT_COMMIT=$(cat $S/.commit) OUT=$R/$n \
     timeout $t bash benchmarks/h200_run.sh $w > $R/$n.out 2>&1)
  grep -E "\('(super|nano|qwen)|passed|failed|Error" $R/$n.out | sed "s/^/$n /" | cut -c1-330
}
run quick 90 tests PYTEST_ARGS="tests/test_mamba2_gpu.py tests/test_gdn_gpu.py -k split_ --maxfail=3"
run m2 70 bench-mamba2 BENCH_ARGS="--reps 10 --batches 256 --windows 16 --window-sweep 16 --states f32 --shapes super120b,nano4b"
run gdn 70 bench-gdn GDN_BENCH_ARGS="--reps 10 --no-fla --batches 256 --windows 16 --window-sweep 16 --states f32 --shapes qwen4b,qwen122b"
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=/tmp/aotC
cd $S
for f in mamba2:super120b,nano4b gdn:qwen4b,qwen122b; do
  timeout 60 python3 benchmarks/profile_steps.py --family ${f%%:*} --shapes ${f#*:} --out $R 2>&1 | grep -E "step|Error" | cut -c1-250
done
for f in mamba2:super120b gdn:qwen4b gdn:qwen122b; do
  timeout 100 ncu --clock-control none -k regex:Records --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats python3 benchmarks/profile_steps.py --single --family ${f%%:*} --shapes ${f#*:} --out $R/ncu > $R/ncu-${f#*:}.txt 2>&1
  grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Block Limit (Reg|Shared)|Warp Cycles Per Issued" $R/ncu-${f#*:}.txt | sed "s/^/${f#*:} /" | cut -c1-120
done
cd $D
run tests 240 tests PYTEST_ARGS="--maxfail=5 --durations=3"
tail -3 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run

# ---- call U (.device/call_u.sh) ----
#!/usr/bin/env bash
# Call U: final side-by-side benchmarks on C: Mamba-2 with FlashInfer's peers, GDN with fla.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapC
export PYTHONUNBUFFERED=1
[ -d /tmp/aotC ] || { mkdir -p /tmp/aotC && tar xJf $D/aotC.tar.xz -C /tmp/aotC --strip-components=1; }
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotC REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 170 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "amortized|selective_state_update\[|autotune pass" $R/peers.out | tail -24 | cut -c1-200
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 190 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "copy|\('(super|nano)" $R/m2.out | cut -c1-220
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 190 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen" $R/gdn.out | cut -c1-220
cd $OUT && tar czf run.tgz run && rm -rf run

# ---- call V (.device/call_v.sh) ----
#!/usr/bin/env bash
# Call V: D (staged ring rows in the records kernels): split tests, the final side-by-side sweeps
# (FlashInfer peers, fla), per-kernel profile, then the full GPU suite.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapD
export PYTHONUNBUFFERED=1
rm -rf /tmp/aotD && mkdir -p /tmp/aotD && tar xJf $D/aotD.tar.xz -C /tmp/aotD --strip-components=1
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotD REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
PYTEST_ARGS="tests/test_mamba2_gpu.py tests/test_gdn_gpu.py -k split_ --maxfail=3" OUT=$R/quick timeout 90 bash benchmarks/h200_run.sh tests > $R/quick.out 2>&1
tail -1 $R/quick.out
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 170 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "tuned amortized" $R/peers.out | cut -c1-120
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 190 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)', (1|8|256), 16, 'f32'" $R/m2.out | cut -c1-200
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 190 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen(4|122)b', (1|8|256), 16, 'f32'" $R/gdn.out | cut -c1-200
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc
for f in mamba2:super120b,nano4b gdn:qwen4b,qwen122b; do
  timeout 60 python3 benchmarks/profile_steps.py --family ${f%%:*} --shapes ${f#*:} --out $R 2>&1 | grep -E "held|flush:|Error" | cut -c60-250
done
cd $D/snapD
PYTEST_ARGS="--maxfail=5 --durations=3" OUT=$R/tests timeout 240 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
tail -2 $R/tests.out
cd $OUT && tar czf run.tgz run && rm -rf run
# ---- call W (.device/call_w.sh) ----
#!/usr/bin/env bash
# Call W: ncu detail on C's records kernels (where their ~30 us per step go): instruction mix,
# stall reasons, scheduler statistics, for a non-flush and a flush step at batch 256.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapC
export PYTHONUNBUFFERED=1
rm -rf /tmp/aotC && mkdir -p /tmp/aotC && tar xJf $D/aotC.tar.xz -C /tmp/aotC --strip-components=1
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=/tmp/aotC
R=$OUT/run; mkdir -p $R; cd $S
for f in mamba2:super120b gdn:qwen4b; do
  timeout 200 ncu --clock-control none --kernel-name-base demangled -k regex:Records \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section InstructionStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --metrics smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_membar,smsp__pcsamp_warps_issue_stalled_drain,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__pcsamp_warps_issue_stalled_imc_miss,smsp__pcsamp_warps_issue_stalled_branch_resolving,smsp__pcsamp_warps_issue_stalled_sleeping,smsp__inst_executed.sum,smsp__cycles_active.avg \
    python3 benchmarks/profile_steps.py --single --family ${f%%:*} --shapes ${f#*:} --out $R/x > $R/ncu-${f#*:}.txt 2>&1
  grep -E "Records<|Duration|Executed Instructions |Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|Achieved Occupancy|inst_executed.sum|stalled_(long|barrier|short|wait|mio|lg|math|selected|not_sel|no_inst|branch|dispatch)" $R/ncu-${f#*:}.txt | cut -c1-120
done
cd $OUT && tar czf run.tgz run && rm -rf run
# ---- call X (.device/call_x.sh; modules: python -m replayssm_jit.aot with REPLAYSSM_JIT_DEBUG=1 for the two benchmark specs at L = 16 and L = 1) ----
#!/usr/bin/env bash
# Call X: per-instruction executed counts and stall samples of C's records kernels (a -lineinfo
# build of the benchmark specs), a non-flush (held 8) and a flush step at batch 256.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapC
export PYTHONUNBUFFERED=1
source $D/prelude.sh
export PYTHONPATH=$S:$PYTHONPATH TVM_FFI_DISABLE_TORCH_C_DLPACK=1 REPLAYSSM_CACHE_DIR=/tmp/rc REPLAYSSM_AOT_DIR=$D/aotL REPLAYSSM_JIT_DEBUG=1 REPLAYSSM_DISABLE_JIT=1
R=$OUT/run; mkdir -p $R; cd $S
for f in mamba2:super120b gdn:qwen4b; do
  timeout 120 ncu --clock-control none --kernel-name-base demangled -k regex:Records --section SourceCounters \
    --page source --print-source sass --csv \
    python3 benchmarks/profile_steps.py --single --family ${f%%:*} --shapes ${f#*:} --out $R/x > $R/src-${f#*:}.csv 2> $R/src-${f#*:}.err
  echo "${f#*:}: $(wc -l < $R/src-${f#*:}.csv) lines"; tail -2 $R/src-${f#*:}.err
done
cd $OUT && tar czf run.tgz run && rm -rf run
# ---- call Y (.device/call_y.sh) ----
#!/usr/bin/env bash
# Call Y: W (records kernels with column copies and register decay scans): split tests, then
# batch 8 and 256 at L = 16 for both families.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapW
export PYTHONUNBUFFERED=1
rm -rf /tmp/aotW && mkdir -p /tmp/aotW && tar xJf $D/aotW.tar.xz -C /tmp/aotW --strip-components=1
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotW REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
PYTEST_ARGS="tests/test_mamba2_gpu.py tests/test_gdn_gpu.py -k split_ --maxfail=3" OUT=$R/quick timeout 60 bash benchmarks/h200_run.sh tests > $R/quick.out 2>&1
tail -1 $R/quick.out
BENCH_ARGS="--reps 8 --batches 8,256 --windows 16 --window-sweep 16 --states f32 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 60 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)" $R/m2.out | cut -c1-200
GDN_BENCH_ARGS="--reps 8 --no-fla --batches 8,256 --windows 16 --window-sweep 16 --states f32 --shapes qwen4b,qwen122b" \
  OUT=$R/gdn timeout 60 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen" $R/gdn.out | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run
