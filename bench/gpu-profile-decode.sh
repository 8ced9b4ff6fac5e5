#!/usr/bin/env bash
# On the GPU machine, after `bash .ci/gpu build`: Nsight Compute over the decode steps of
# refit-bench generate (issue 16), one table per batch size: every kernel of ~one layer with
# its duration, DRAM throughput (% of peak), DRAM bytes read and grid size.
#   BATCHES="1 64 256" SKIP=14000 COUNT=50 bash bench/gpu-profile-decode.sh
#   BATCHES="64" TOKENS=64 SKIP=25000 COUNT=36 bash bench/gpu-profile-decode.sh
# SKIP kernels (synthetic weight fills and copies are filtered out first) are passed over so
# that the profiled ones are decode steps (replayed from CUDA graphs: --graph-profiling node);
# check the table shows decode_attention_kernel, not prefill's SDPA. Clocks are ncu's default
# (locked to base): absolute times are slower than a real run, the ratios between kernels hold;
# NCU_ARGS="--clock-control none" runs them at the clocks of a real run.
# Tiny kernels still read high under ncu (one replay per kernel, no overlap): for the step as
# a whole trust refit-bench generate's decode_step_seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
BATCHES=${BATCHES:-1 64 256}
SKIP=${SKIP:-14000}
COUNT=${COUNT:-50}
TOKENS=${TOKENS:-16}   # new tokens per request: more puts a larger share of kernels in decode
mkdir -p "$OUT"
for b in $BATCHES; do
  timeout 600 ncu --target-processes all --graph-profiling node --cache-control none \
    --kernel-name-base function --kernel-name 'regex:^(?!(fill_kernel|copy_batch_kernel|digest)).*' \
    --launch-skip "$SKIP" --launch-count "$COUNT" \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers ${NCU_ARGS:-} \
    --csv --log-file "$OUT/ncu-decode-b$b.csv" \
    ./build-gpu/bin/refit-bench generate --config configs/bench-generate-h200.yaml --batch "$b" \
    --prompt-len 128 --max-tokens "$TOKENS" --repeat 1 --no-gap --json > "$OUT/ncu-decode-b$b.json" \
    2> "$OUT/ncu-decode-b$b.log" || echo "batch $b: ncu failed ($?), see $OUT/ncu-decode-b$b.log"
  python3 - "$OUT/ncu-decode-b$b.csv" "$b" <<'PY'
import csv, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
if not rows:
    sys.exit(f"batch {sys.argv[2]}: no kernels profiled (SKIP too large?)")
head = rows[0]
k, m, v, i = (head.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value", "ID"))
kernels = {}
for r in rows[1:]:
    kernels.setdefault(r[i], {"name": r[k]})[r[m]] = r[v]
print(f"batch {sys.argv[2]}: ns | dram % of peak | dram bytes read | grid | warps active % | blocks/SM by smem | by regs | kernel")
for x in kernels.values():
    print(" | ".join([x.get("gpu__time_duration.sum", "?"),
                      x.get("dram__throughput.avg.pct_of_peak_sustained_elapsed", "?"),
                      x.get("dram__bytes_read.sum", "?"), x.get("launch__grid_size", "?"),
                      x.get("sm__warps_active.avg.pct_of_peak_sustained_active", "?"),
                      x.get("launch__occupancy_limit_shared_mem", "?"),
                      x.get("launch__occupancy_limit_registers", "?"), x["name"][:70]]))
PY
done
