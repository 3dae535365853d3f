#!/usr/bin/env bash
# Call F1: F (main candidate: records-instructions merged, flush-every-step at small batch): the
# full GPU suite, then FlashInfer's Mamba-2 peers side by side with ours.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapF
export PYTHONUNBUFFERED=1
[ -d /tmp/aotF ] || { mkdir -p /tmp/aotF && tar xJf $D/aotF.tar.xz -C /tmp/aotF --strip-components=1; }
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotF REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
PYTEST_ARGS="--maxfail=10 --durations=5" OUT=$R/tests timeout 300 bash benchmarks/h200_run.sh tests > $R/tests.out 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.out | tail -12 | cut -c1-250
BENCH_ARGS="--reps 8 --batches none --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes super120b --tiling-sweep super120b:1:16:f32,nano4b:1:16:f32" \
  OUT=$R/m2tile timeout 90 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2tile.out 2>&1
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['shape'],r['batch'],r['kernel'],round(r['us'],2)) for r in d['rows'] if '@' in r['kernel'] and 'split' not in r['kernel']]" $R/m2tile/mamba2.json
GDN_BENCH_ARGS="--reps 8 --no-fla --batches none --window-sweep 16 --window-sweep-batch 1 --states f32 --shapes qwen4b --tiling-sweep qwen4b:1:16:f32,qwen122b:1:16:f32" \
  OUT=$R/gdntile timeout 90 bash benchmarks/h200_run.sh bench-gdn > $R/gdntile.out 2>&1
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['shape'],r['batch'],r['kernel'],round(r['us'],2)) for r in d['rows'] if '@' in r['kernel'] and 'split' not in r['kernel']]" $R/gdntile/gdn.json
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 200 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "amortized|selective_state_update\[|autotune pass" $R/peers.out | tail -24 | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run
#!/usr/bin/env bash
# Call F2: F's final sweeps: Mamba-2 and GDN (fla side by side), batch 1-512, L sweep, FP32/BF16.
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapF
export PYTHONUNBUFFERED=1
[ -d /tmp/aotF ] || { mkdir -p /tmp/aotF && tar xJf $D/aotF.tar.xz -C /tmp/aotF --strip-components=1; }
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotF REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 230 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "copy|\('(super|nano)" $R/m2.out | grep "f32" | cut -c1-220
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 230 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen" $R/gdn.out | grep "f32" | cut -c1-220
cd $OUT && tar czf run.tgz run && rm -rf run
#!/usr/bin/env bash
# Call G1: F's row-tile sweep at batch 1 and 8 (conventional, per-item, flush-every-step, split).
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapF
export PYTHONUNBUFFERED=1
[ -d /tmp/aotF ] || { mkdir -p /tmp/aotF && tar xJf $D/aotF.tar.xz -C /tmp/aotF --strip-components=1; }
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotF REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
BENCH_ARGS="--reps 8 --batches none --window-sweep 16 --window-sweep-batch 8 --states f32 --shapes super120b --tiling-sweep super120b:8:16:f32,nano4b:8:16:f32,super120b:1:16:f32" \
  OUT=$R/m2tile timeout 150 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2tile.out 2>&1
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['shape'],r['batch'],r['kernel'],round(r['us'],2)) for r in d['rows']]" $R/m2tile/mamba2.json
GDN_BENCH_ARGS="--reps 8 --no-fla --batches none --window-sweep 16 --window-sweep-batch 8 --states f32 --shapes qwen4b --tiling-sweep qwen4b:8:16:f32,qwen122b:8:16:f32" \
  OUT=$R/gdntile timeout 120 bash benchmarks/h200_run.sh bench-gdn > $R/gdntile.out 2>&1
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['shape'],r['batch'],r['kernel'],round(r['us'],2)) for r in d['rows']]" $R/gdntile/gdn.json
cd $OUT && tar czf run.tgz run && rm -rf run
#!/usr/bin/env bash
# Call F3: the final run in one call: FlashInfer's Mamba-2 peers, then our Mamba-2 and GDN sweeps
# (fla side by side in the GDN sweep).
D=$(cd "$(dirname "$0")" && pwd); S=$D/snapF
export PYTHONUNBUFFERED=1
[ -d /tmp/aotF ] || { mkdir -p /tmp/aotF && tar xJf $D/aotF.tar.xz -C /tmp/aotF --strip-components=1; }
R=$OUT/run; mkdir -p $R
cd $S
export DEVICE_DIR=$D REPLAYSSM_AOT_DIR=/tmp/aotF REPLAYSSM_GIT_COMMIT=$(cat $S/.commit)
PEER_ARGS="--small-batches 1,8 --big-batches 256,64 --rounds 2 --reps 20 --no-copy" OUT=$R timeout 200 bash benchmarks/h200_run.sh peers > $R/peers.out 2>&1
grep -E "tuned amortized|selective_state_update\[" $R/peers.out | tail -8 | cut -c1-140
BENCH_ARGS="--reps 8 --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16 --shapes super120b,nano4b" \
  OUT=$R/m2 timeout 150 bash benchmarks/h200_run.sh bench-mamba2 > $R/m2.out 2>&1
grep -E "\('(super|nano)[a-z0-9]*', (1|8|256), 16, 'f32'" $R/m2.out | cut -c1-200
GDN_BENCH_ARGS="--reps 8 --shapes qwen4b,qwen122b --batches 1,8,64,256,512 --windows 16 --window-sweep 4,8,32 --states f32,bf16" \
  OUT=$R/gdn timeout 150 bash benchmarks/h200_run.sh bench-gdn > $R/gdn.out 2>&1
grep -E "\('qwen[0-9]*b', (1|8|256), 16, 'f32'" $R/gdn.out | cut -c1-200
cd $OUT && tar czf run.tgz run && rm -rf run
