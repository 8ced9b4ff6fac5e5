#!/usr/bin/env bash
# On the GPU machine, after `bash .ci/gpu build`: a CUPTI kernel trace of refit-bench generate's
# decode steps (issue 16), through bench/ktrace.cpp preloaded into refit-bench and the
# refit-runtime it spawns; bench/ktrace.py then prints, per step, the time the kernels cover
# and the idle time, the kernels by name, and one layer's timeline.
#   BATCH=64 TOKENS=24 bash bench/gpu-trace-decode.sh
# CUPTI from the CUDA toolkit (include/ and lib64/ under /usr/local/cuda or extras/CUPTI).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
BATCH=${BATCH:-64}
TOKENS=${TOKENS:-24}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd) # absolute: LD_PRELOAD and the spawned runtime need it as it is
CI=""; CL=""
for d in /usr/local/cuda/extras/CUPTI /usr/local/cuda; do
  [ -z "$CI" ] && [ -f "$d/include/cupti.h" ] && CI=$d/include
  for l in "$d/lib64" "$d/lib"; do [ -z "$CL" ] && ls "$l"/libcupti.so* > /dev/null 2>&1 && CL=$l; done
done
[ -n "$CI" ] && [ -n "$CL" ] || { echo "no CUPTI under /usr/local/cuda"; exit 1; }
g++ -std=c++17 -O2 -shared -fPIC -I"$CI" -I/usr/local/cuda/include bench/ktrace.cpp \
  -L"$CL" -lcupti -Wl,-rpath,"$CL" -o "$OUT/libktrace.so" || exit 1
rm -f "$OUT"/kt.*
KTRACE_OUT="$OUT/kt" LD_PRELOAD="$OUT/libktrace.so" timeout 300 \
  ./build-gpu/bin/refit-bench generate --config configs/bench-generate-h200.yaml --batch "$BATCH" \
  --prompt-len 128 --max-tokens "$TOKENS" --repeat 1 --no-gap --json > "$OUT/trace-b$BATCH.json" \
  2> "$OUT/trace-b$BATCH.log" || echo "refit-bench failed ($?), see $OUT/trace-b$BATCH.log"
python3 bench/ktrace.py "$OUT/kt" | tee "$OUT/trace-b$BATCH.txt"
