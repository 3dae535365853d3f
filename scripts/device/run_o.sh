# GPU call O (issue 39; about 220 s): FlashInfer's checkpointing_ssu verify for the grand run
# (run_m.sh's FlashInfer line found no flashinfer: the machine's /tmp/site came from a call that
# did not carry it), then ncu of GDN's split verify (qwen122b) and KDA's per-item verify
# (kimi48b) at batch 256, T = 4: duration, occupancy, stalls, DRAM throughput.
source scripts/device/suites.sh
python3 -c "import flashinfer" 2>/dev/null || tar xJf .device/flashinfer.tar.xz -C /tmp/site
mkdir -p $OUT/fi
FLASHINFER_DISABLE_JIT=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 timeout 150 python3 .device/anchors/anchor_lp_spec.py \
  --aot-dir .device/fi-aot --skip lp,tune --spec-batches 256,64,8,1 --spec-ts 2,4,8 --out $OUT/fi > $OUT/fi.txt 2>&1
echo "== FlashInfer verify at $(elapsed)"; grep -E "monolith.*mixed|auto.*mixed" $OUT/fi.txt | head -30 | cut -c1-160
NCU="ncu --clock-control none --kernel-name-base demangled --launch-skip 4"
for shape in qwen122b kimi48b; do
  ONE="python3 benchmarks/bench_verify.py --no-baselines --verify-kernels= --shapes $shape --batches 256 --ts 4 \
    --reps 1 --rounds 1 --cycle-steps 1 --min-pool-bytes 6e8 --out /tmp/ncu-out"
  in_tree main timeout 80 $NCU -k 'regex:gdn::Verify' -c 2 --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis $ONE > $OUT/ncu-$shape-b256-T4.txt 2>&1
  echo "== ncu $shape at $(elapsed)"; grep -E "per_item|Verify|Duration|Registers Per|Achieved Occupancy|DRAM Throughput" \
    $OUT/ncu-$shape-b256-T4.txt | cut -c1-140
done
(cd $OUT && tar cJf all.tar.xz --exclude all.tar.xz . 2>/dev/null)
