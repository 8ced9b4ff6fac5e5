#!/usr/bin/env bash
# One device run (issue 17): build, the GPU direct tests, refit-bench direct + packed on
# Qwen3-30B-A3B FSDP1 -> TP1 in the same call. Output under $OUT.
set -u
cd "$(dirname "$0")"
source ../../.device/gpu-env.sh > "$OUT/env.log" 2>&1
nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv > "$OUT/gpus.csv" 2>&1
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
cmake -S . -B build-gpu $GPU_CMAKE_ARGS -DREFIT_CUDA=ON > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
timeout 110 cmake --build build-gpu -j 16 --target refit-bench refit-runtime test_gpu > "$OUT/build.log" 2>&1
rc=$?; echo "build rc=$rc after $(el) s"
[ $rc -ne 0 ] && { grep -E "error|FAILED" -A5 "$OUT/build.log" | head -40; tail -5 "$OUT/build.log"; exit 1; }
timeout 25 ./build-gpu/bin/test_gpu --gtest_filter='GpuKernels.*:GpuDirectPublication.*:GpuPublication.ByteExactTp1' > "$OUT/gpu-direct-tests.log" 2>&1
echo "gpu tests rc=$? after $(el) s"; grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) |tests ran|Failure|Which is" "$OUT/gpu-direct-tests.log" | head -20
CFG=configs/qwen3-30b-a3b-tp1.yaml
timeout 50 ./build-gpu/bin/refit-bench publish --config $CFG --mode direct --iterations 5 --verify --json > "$OUT/direct.json" 2> "$OUT/direct.log"
echo "direct rc=$? after $(el) s"; tail -3 "$OUT/direct.log"
python3 -c "import json;r=json.load(open('$OUT/direct.json'));print({k:r.get(k) for k in ['seconds','gbps','bound_seconds','copy_bound_seconds','ratio','ratio_to_copy','verified','bytes_local','bytes_cross','chunks','peak_extra_device_bytes']})" 2>&1 | tail -2
left=$(( 190 - $(el) ))
[ $left -gt 20 ] && timeout $left ./build-gpu/bin/refit-bench publish --config $CFG --mode packed --iterations 3 --json > "$OUT/packed.json" 2> "$OUT/packed.log"
echo "packed rc=$? after $(el) s"; tail -3 "$OUT/packed.log"
python3 -c "import json;r=json.load(open('$OUT/packed.json'));print({k:r.get(k) for k in ['seconds','gbps','copy_bound_seconds','ratio_to_copy','chunks']})" 2>&1 | tail -2
