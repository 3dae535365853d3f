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
