#!/usr/bin/env python3
"""HF tokenizers' single-thread encode throughput over a JSON-lines corpus, measured the way
`refit-bench tokenize` measures refit's (passes over every line for at least --seconds,
MB = 1e6 bytes of UTF-8 input), so both can run in one job (bench/gpu-load.sh).

  RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false python3 bench/tokenize_hf.py TOKENIZER CORPUS"""
import json, sys, time
from tokenizers import Tokenizer
import tokenizers

tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8") if l.strip()]
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
nbytes = sum(len(t.encode("utf-8")) for t in texts)
for t in texts:  # warm-up pass
    tok.encode(t, add_special_tokens=False)
passes, start = 0, time.perf_counter()
while True:
    for t in texts:
        tok.encode(t, add_special_tokens=False)
    passes += 1
    el = time.perf_counter() - start
    if el >= seconds:
        break
print(json.dumps({"impl": "hf-tokenizers " + tokenizers.__version__, "mb_per_s": nbytes * passes / el / 1e6,
                  "bytes_per_pass": nbytes, "passes": passes, "seconds": el, "threads": 1}))
