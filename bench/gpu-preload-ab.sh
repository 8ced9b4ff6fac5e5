#!/usr/bin/env bash
# On the GPU machine, after `bash .ci/gpu build` (build-gpu/; `.device/` carried along): the
# preloading GEMM (REFIT_PRELOAD_GEMM, docs/bf16-engine.md §7) tested, then timed against cuBLAS
# in the same lease, then HF transformers at batch 64 (issue 16's 10x target). One call:
#   source .device/gpu-env.sh && bash .ci/gpu build && bash bench/gpu-preload-ab.sh
# Writes $OUT/preload-tests.log, $OUT/ab-<variant>-<round>.json, $OUT/hf-generate.json and
# prints one line per run (ms a decode step, tok/s, roofline ratio, preloading-GEMM launches).
#   ROUNDS (2) interleaved rounds of VARIANTS (space-separated "name:ENV=V,ENV2=V"; default:
#   cuBLAS, qkv + o_proj, + the router, + the mix's early trigger) at BATCH (64); HF=0 skips
#   HF; TESTS=0 skips the tests; TRACE="ENV=V,..." adds a CUPTI trace of the step under those
#   knobs (bench/gpu-trace-decode.sh, into $OUT/trace/), e.g. TRACE=REFIT_PRELOAD_GEMM=2.
#   RECIPE (configs/bench-generate-h200.yaml): another recipe, e.g. a smaller KV budget on an H100.
#   TESTS_RE ('GpuPreloadGemm|GpuEngine|GpuResidualKernels'): the ctest names to run first, e.g.
#   'GpuExpertSelfSort|GpuEngine' with VARIANTS='base:REFIT_EXPERT_FLOW=0 flow:REFIT_EXPERT_FLOW=1'.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
ROUNDS=${ROUNDS:-2}
BATCH=${BATCH:-64}
HF=${HF:-1}
TESTS=${TESTS:-1}
LIMIT=${LIMIT:-300}
VARIANTS=${VARIANTS:-"cublas:REFIT_PRELOAD_GEMM=0 preload:REFIT_PRELOAD_GEMM=1 router:REFIT_PRELOAD_GEMM=2 trigger:REFIT_PRELOAD_GEMM=2,REFIT_MIX_TRIGGER_EARLY=1"}
RECIPE=${RECIPE:-configs/bench-generate-h200.yaml}
TESTS_RE=${TESTS_RE:-'GpuPreloadGemm|GpuEngine|GpuResidualKernels'}
mkdir -p "$OUT"
status=0

if [ "$TESTS" = 1 ]; then
  # The kernel alone, then the engine's paths that take it (ctest names are Suite.Name).
  timeout 900 ctest --test-dir build-gpu -R "$TESTS_RE" \
    --output-on-failure \
    --timeout 300 > "$OUT/preload-tests.log" 2>&1 || status=1
  grep -E "tests passed|Failed|\*\*\*|No tests were found" "$OUT/preload-tests.log" | tail -20
  grep -q "No tests were found" "$OUT/preload-tests.log" && { echo "TESTS: NONE MATCHED"; status=1; }
  # The clusters this device holds and the plans they give (ctest shows a passing test's output
  # only on failure, so the planner test runs once more here for its [ measured ] lines).
  if [ -x ./build-gpu/bin/test_gpu_preload_gemm ]; then
    ./build-gpu/bin/test_gpu_preload_gemm --gtest_filter='*ModelShapesArePlanned*' 2>&1 \
      | grep -F "[ measured ]" | tee -a "$OUT/preload-tests.log"
  fi
fi

for round in $(seq 1 "$ROUNDS"); do
  for variant in $VARIANTS; do
    name=${variant%%:*}
    envs=${variant#*:}
    json="$OUT/ab-$name-$round.json"
    env ${envs//,/ } timeout "$LIMIT" ./build-gpu/bin/refit-bench generate --config $RECIPE \
      --batch "$BATCH" --prompt-len 128 --max-tokens 64 --repeat 1 --no-gap --json > "$json" \
      2> "$OUT/ab-$name-$round.log" || { echo "failed: $name round $round"; status=1; }
    python3 - "$json" "$name" "$round" <<'PY'
import json, sys
path, name, rnd = sys.argv[1:]
try:
    r = json.load(open(path))
except Exception as e:
    print("%-10s round %s: unreadable (%s)" % (name, rnd, e)); sys.exit(0)
for b in r.get("batches", []):
    tok_s = b.get("decode_tok_s") or 0
    step_ms = 1000.0 * (b.get("decode_step_seconds") or float("nan"))
    # Projections the preloading GEMM ran (0: none planned on this device, all on cuBLAS).
    preloads = sum(run.get("preload_gemms", 0) for run in b.get("runs", []))
    print("%-10s round %s batch %3d: %.3f ms a step, %.1f tok/s, roofline %s, preload GEMMs %d" % (
        name, rnd, b["batch"], step_ms, tok_s, b.get("roofline_ratio"), preloads))
PY
  done
done

if [ "$HF" = 1 ]; then
  timeout 600 python3 bench/hf_generate.py --config $RECIPE --batch 64 --prompt-len 128 \
    --max-tokens 64 --repeat 1 > "$OUT/hf-generate.json" 2> "$OUT/hf-generate.log" || status=1
  python3 - "$OUT/hf-generate.json" <<'PY' || status=1
import json, sys
for b in json.load(open(sys.argv[1])).get("batches", []):
    # 10x HF's tok/s at this batch is a decode step of batch / (10 tok/s) seconds.
    print("HF batch %d: %.2f tok/s; 10x needs %.3f ms a step" % (
        b["batch"], b["decode_tok_s"], 1000.0 * b["batch"] / (10.0 * b["decode_tok_s"])))
PY
fi
if [ -n "${TRACE:-}" ]; then
  env ${TRACE//,/ } OUT="$OUT/trace" BATCH="$BATCH" TOKENS=24 bash bench/gpu-trace-decode.sh \
    | tail -60 || status=1
fi
exit $status
