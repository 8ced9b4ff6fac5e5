#!/usr/bin/env bash
# On the GPU machine, after a CUDA build in build-gpu/: the routed-expert kernel choices of the
# bf16 engine, measured in one run on one H200 (issue 16), to pick the defaults.
#   1. refit-expert-bench: the expert kernels alone (expert_mma at every k-split and register
#      staging, the expert GEMV) against the device-copy bound measured in the same process.
#   2. refit-bench generate (Qwen3-30B-A3B shape, synthetic bf16) under each engine setting
#      below; every run reports decode tok/s and roofline_ratio against its own copy bound.
# Writes $OUT/experts.json and $OUT/generate-<name>.json, prints a table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
BATCH=${BATCH:-1,16,64,256}
P=${P:-128}
T=${T:-64}
REPEAT=${REPEAT:-2}
LIMIT=${LIMIT:-200}   # seconds per command
RECIPE=configs/bench-generate-h200.yaml
mkdir -p "$OUT"
status=0
timeout "$LIMIT" ./build-gpu/bin/refit-expert-bench --batch 1,2,4,8,16,32,64,128,256 --json \
  > "$OUT/experts.json" || { echo "refit-expert-bench failed ($?)" >&2; status=1; }

# name: environment (the engine reads these when it is built; docs/operations.md)
settings=(
  "default:"
  "grouped:REFIT_EXPERT_MMA_MAX_COPIES=0 REFIT_EXPERT_GEMV_MAX_COPIES=8"
  "dense-cublas:REFIT_DENSE_MMA_MAX_ROWS=0"
  "l2-normal:REFIT_EXPERT_MMA_EVICT_FIRST=0"
)
for s in "${settings[@]}"; do
  name=${s%%:*}
  vars=${s#*:}
  echo "+ $vars refit-bench generate" >&2
  env $vars timeout "$LIMIT" ./build-gpu/bin/refit-bench generate --config $RECIPE \
    --batch "$BATCH" --prompt-len "$P" --max-tokens "$T" --repeat "$REPEAT" --no-gap --json \
    > "$OUT/generate-$name.json" || { echo "failed ($?): $name" >&2; status=1; }
done

python3 - "$OUT" "${settings[@]}" <<'PY'
import json, sys, os
out = sys.argv[1]
try:
    e = json.load(open(os.path.join(out, "experts.json")))
    print("expert kernels alone, copy bound %.0f GB/s" % e["copy_bound_gbps"])
    best = {}
    for r in e["rows"]:
        print("  batch %4d experts %3d %-18s %8.1f us/layer  ratio %.3f" % (
            r["batch"], r["experts_used"], r["path"], r["layer_us"], r["ratio"]))
        if r["batch"] not in best or r["layer_us"] < best[r["batch"]]["layer_us"]:
            best[r["batch"]] = r
    for b, r in sorted(best.items()):
        print("  best at batch %4d: %s (%.3f)" % (b, r["path"], r["ratio"]))
except Exception as ex:
    print("experts.json:", ex)
for s in sys.argv[2:]:
    name, vars = s.split(":", 1)
    try:
        g = json.load(open(os.path.join(out, "generate-%s.json" % name)))
        row = "  ".join("b%d %.1f tok/s (%.3f)" % (b["batch"], b["decode_tok_s"], b["roofline_ratio"])
                        for b in g["batches"])
        print("%-11s %s" % (name, row))
    except Exception as ex:
        print("%-11s %s" % (name, ex))
PY
exit $status
