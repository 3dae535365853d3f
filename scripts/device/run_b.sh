# GPU call B: the KDA, SR-twin and verify suites, then main's tree on every failed id of both
# calls (copy call A's $OUT/*.txt into .device/call-a/ before this call; they come back too).
source scripts/device/suites.sh
[ -d $D/call-a ] && cp $D/call-a/*.txt $OUT/ 2>/dev/null
suite kda 150 tests/kda/test_kda_gpu.py tests/protocol/test_sr_twin_gpu.py -n 2
suite verify 200 tests/protocol/test_verify_gpu.py -n 2
rerun_on_main 150
