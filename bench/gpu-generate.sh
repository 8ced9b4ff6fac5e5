#!/usr/bin/env bash
# On the GPU machine, after `bash .ci/gpu build` (build-gpu/): refit-bench generate and its HF
# transformers peer (bench/hf_generate.py) in one run, one H200 (issue 16). Writes $OUT/*.json.
#   speed: the Qwen3-30B-A3B shape (48 layers) with random bf16 weights in both (refit:
#          synthetic from job.seed; HF: torch init on the GPU).
#   gap:   a $LAYERS-layer checkpoint written by hf_generate.py --save, loaded by both, so the
#          bf16-vs-fp32 logprob gaps of refit and HF are measured on the same weights.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
BATCH=${BATCH:-1,16,64,256}
P=${P:-128}
T=${T:-64}
LAYERS=${LAYERS:-3}
LIMIT=${LIMIT:-1200}   # seconds per command
CKPT=${CKPT:-/tmp/refit-generate-ckpt}
RECIPE=configs/bench-generate-h200.yaml
mkdir -p "$OUT"
status=0
run() { echo "+ $*" >&2; timeout "$LIMIT" "$@" || { echo "failed ($?): $*" >&2; status=1; }; }
W="--batch $BATCH --prompt-len $P --max-tokens $T"

run ./build-gpu/bin/refit-bench generate --config $RECIPE $W --json > "$OUT/refit-generate.json"
run python3 bench/hf_generate.py --config $RECIPE $W > "$OUT/hf-generate.json"
run python3 bench/hf_generate.py --config $RECIPE --layers "$LAYERS" --save "$CKPT" > "$OUT/checkpoint.json"
run ./build-gpu/bin/refit-bench generate --config $RECIPE --model "$CKPT" $W --json \
  > "$OUT/refit-generate-${LAYERS}layers.json"
run python3 bench/hf_generate.py --gap "$CKPT" $W > "$OUT/hf-gap-${LAYERS}layers.json"
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception as e:
        return {"error": str(e)}
r, h = load("refit-generate.json"), load("hf-generate.json")
hf = {b["batch"]: b for b in h.get("batches", [])}
for b in r.get("batches", []):
    x = hf.get(b["batch"], {})
    print("batch %4d  refit decode %9.1f tok/s roofline %s  HF decode %s tok/s  refit gap max %s" % (
        b["batch"], b["decode_tok_s"] or 0, b["roofline_ratio"], x.get("decode_tok_s"),
        b["logprob_gap"].get("max_abs")))
PY
exit $status
