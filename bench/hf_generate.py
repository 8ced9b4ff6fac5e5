#!/usr/bin/env python3
"""The HF transformers peer of `refit-bench generate` (issue 16), for the GPU machine
(transformers 5.x, torch 2.x, one CUDA device).

Speed (default): builds Qwen3MoeForCausalLM from a recipe's model section (or a model
directory's config.json), optionally truncated to --layers N, with random bf16 weights
initialised directly on the GPU, and runs `generate` per batch size with the same workload as
refit-bench generate: prompts of --prompt-len random token ids (seeded), --max-tokens new
tokens, sampling at temperature 1 with top_k 0 and top_p 1, min_new_tokens = max_new_tokens so
every sequence runs to length. Per batch, medians over --repeat runs after one warm-up:
  ttft_seconds   = generate(max_new_tokens=1) (prefill + the first token)
  prefill_tok_s  = batch * prompt_len / ttft_seconds
  decode_tok_s   = batch * (max_tokens - 1) / (generate(max_tokens) - ttft)

    python3 bench/hf_generate.py --config configs/qwen3-30b-a3b.yaml --batch 1,16,64 \\
        --prompt-len 128 --max-tokens 64 > hf-generate.json

Save (--save DIR): writes the randomly initialised model (HF save_pretrained: config.json,
safetensors, generation_config.json) so refit can load the SAME weights
(`refit-bench generate --model DIR`), and exits.

    python3 bench/hf_generate.py --config configs/qwen3-30b-a3b.yaml --layers 3 --save /tmp/ckpt

Gap (--gap DIR): loads the checkpoint DIR in bf16 and in fp32, generates with the bf16 model
(logits of every step returned), and reports mean and max |logprob of each generated token
under the bf16 decode - under a teacher-forced fp32 forward| (log-softmax in fp32): the
"HF bf16 gap" the issue compares refit's gap (refit-bench generate's logprob_gap) against.

    python3 bench/hf_generate.py --gap /tmp/ckpt --batch 1,16,64 --prompt-len 128 --max-tokens 64

Everything prints one JSON object on stdout; progress goes to stderr.
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="refit recipe whose model: section gives the shape")
    p.add_argument("--model-dir", help="a model directory whose config.json gives the shape")
    p.add_argument("--layers", type=int, default=0, help="truncate to N layers (0: as configured)")
    p.add_argument("--batch", default="1,16,64,256", help="batch sizes, comma separated")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                   help="attn_implementation (default eager)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--save", metavar="DIR", help="save the random model to DIR and exit")
    p.add_argument("--gap", metavar="DIR", help="bf16 vs fp32 logprob gap of checkpoint DIR")
    a = p.parse_args(argv)
    try:
        a.batches = [int(x) for x in a.batch.split(",") if x.strip()]
    except ValueError:
        p.error("--batch: not a comma separated list of integers: " + a.batch)
    if not a.batches or min(a.batches) < 1:
        p.error("--batch: every batch size must be >= 1")
    if a.prompt_len < 1 or a.max_tokens < 1 or a.repeat < 1:
        p.error("--prompt-len, --max-tokens and --repeat must be >= 1")
    if not a.gap and not a.config and not a.model_dir:
        p.error("one of --config, --model-dir or --gap is required")
    return a


HF_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
           "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
           "vocab_size", "tie_word_embeddings", "rms_norm_eps", "rope_theta", "norm_topk_prob"]


def model_section(a):
    """The HF config fields of the recipe's model: section (or of config.json)."""
    if a.model_dir:
        with open(os.path.join(a.model_dir, "config.json")) as f:
            m = json.load(f)
    else:
        import yaml  # PyYAML
        with open(a.config) as f:
            recipe = yaml.safe_load(f)
        m = dict(recipe.get("model") or {})
        if "path" in m:  # a recipe naming a checkpoint: its config.json
            base = os.path.dirname(os.path.abspath(a.config))
            with open(os.path.join(base, m["path"], "config.json")) as f:
                m = json.load(f)
    if m.get("model_type", "qwen3_moe") != "qwen3_moe":
        sys.exit("hf_generate.py: model_type %r is not qwen3_moe" % m.get("model_type"))
    missing = [k for k in HF_KEYS[:9] if k not in m]
    if missing:
        sys.exit("hf_generate.py: the model section lacks " + ", ".join(missing))
    out = {k: m[k] for k in HF_KEYS if k in m}
    if a.layers:
        out["num_hidden_layers"] = a.layers
    return out


def build_config(fields, attn):
    from transformers import Qwen3MoeConfig
    cfg = Qwen3MoeConfig(**fields, decoder_sparse_step=1, mlp_only_layers=[],
                         use_sliding_window=False, sliding_window=None, attention_bias=False,
                         hidden_act="silu",
                         intermediate_size=fields["moe_intermediate_size"] * 8,
                         max_position_embeddings=40960, bos_token_id=151643,
                         eos_token_id=151645)
    cfg._attn_implementation = attn
    return cfg


def random_model(cfg, device, seed):
    """Random bf16 weights initialised on the GPU (no fp32 or host copy)."""
    import torch
    from transformers import Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.to(torch.bfloat16).eval()


def load_model(path, dtype, device, attn):
    from transformers import AutoModelForCausalLM
    try:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    except TypeError:  # transformers 4.x spells it torch_dtype
        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation=attn)
    return m.to(device).eval()


def prompts(batch, length, vocab, seed, rep, device):
    import torch
    g = torch.Generator().manual_seed(seed * 1000003 + batch * 1009 + rep)
    return torch.randint(0, vocab, (batch, length), generator=g).to(device)


def sampling_kwargs(new_tokens):
    return dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, pad_token_id=0, use_cache=True)


def timed_generate(model, ids, new_tokens):
    import torch
    mask = torch.ones_like(ids)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, **sampling_kwargs(new_tokens))
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def speed(a, model, vocab):
    import torch
    batches = []
    timed_generate(model, prompts(min(a.batches), a.prompt_len, vocab, a.seed, 10**6, a.device),
                   a.max_tokens)  # warm-up
    for b in a.batches:
        ttft, total = [], []
        for rep in range(a.repeat):
            ids = prompts(b, a.prompt_len, vocab, a.seed, rep, a.device)
            t1, _ = timed_generate(model, ids, 1)
            tn, out = timed_generate(model, ids, a.max_tokens)
            assert out.shape == (b, a.prompt_len + a.max_tokens), out.shape
            ttft.append(t1)
            total.append(tn)
        t1, tn = statistics.median(ttft), statistics.median(total)
        decode = tn - t1
        row = {"batch": b, "ttft_seconds": t1, "generate_seconds": tn,
               "prefill_tok_s": b * a.prompt_len / t1,
               "decode_seconds": decode,
               "decode_tok_s": b * (a.max_tokens - 1) / decode if a.max_tokens > 1 and decode > 0 else None,
               "decode_step_seconds": decode / (a.max_tokens - 1) if a.max_tokens > 1 else None,
               "generated_tokens": b * a.max_tokens,
               "ttft_seconds_all": ttft, "generate_seconds_all": total,
               "peak_device_bytes": torch.cuda.max_memory_allocated(a.device)}
        print("hf_generate: batch %d: decode %.1f tok/s" % (b, row["decode_tok_s"] or 0),
              file=sys.stderr)
        batches.append(row)
    return batches


def gap(a):
    import torch
    m16 = load_model(a.gap, torch.bfloat16, a.device, a.attn)
    m32 = load_model(a.gap, torch.float32, a.device, a.attn)
    vocab = m16.config.vocab_size
    rows = []
    for b in a.batches:
        ids = prompts(b, a.prompt_len, vocab, a.seed, 0, a.device)
        with torch.inference_mode():
            out = m16.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               return_dict_in_generate=True, output_logits=True,
                               **sampling_kwargs(a.max_tokens))
            seq = out.sequences                                   # [b, P + T]
            new = seq[:, a.prompt_len:]                           # [b, T]
            step = torch.stack(out.logits, 1).float()             # [b, T, V] bf16 decode logits
            lp16 = torch.log_softmax(step, -1).gather(-1, new[..., None])[..., 0]
            inp = seq[:, :-1]
            try:  # only the last T rows: positions P-1 .. P+T-2 predict seq[:, P:]
                ref = m32(input_ids=inp, attention_mask=torch.ones_like(inp),
                          logits_to_keep=a.max_tokens).logits
            except TypeError:
                ref = m32(input_ids=inp, attention_mask=torch.ones_like(inp)).logits
            ref = ref[:, -a.max_tokens:].float()
            lp32 = torch.log_softmax(ref, -1).gather(-1, new[..., None])[..., 0]
        d = (lp16 - lp32).abs()
        rows.append({"batch": b, "tokens": d.numel(), "mean_abs": d.mean().item(),
                     "max_abs": d.max().item()})
        print("hf_generate: gap batch %d: mean %.3g max %.3g" % (b, rows[-1]["mean_abs"],
              rows[-1]["max_abs"]), file=sys.stderr)
    return {"benchmark": "hf_generate_gap", "checkpoint": os.path.abspath(a.gap),
            "reference": "teacher-forced fp32 forward of the same checkpoint (log-softmax in "
                         "fp32) vs the bf16 generate's per-step logits",
            "batches": rows}


def main(argv=None):
    a = parse_args(argv)
    import torch
    import transformers
    env = {"host": platform.node(), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(a.device) if torch.cuda.is_available() else None}
    common = {"prompt_len": a.prompt_len, "max_tokens": a.max_tokens, "seed": a.seed,
              "temperature": 1.0, "top_k": 0, "top_p": 1.0, "attn_implementation": a.attn}
    if a.gap:
        out = gap(a)
        out.update(common, env=env)
        print(json.dumps(out, indent=2))
        return 0
    fields = model_section(a)
    cfg = build_config(fields, a.attn)
    t0 = time.perf_counter()
    model = random_model(cfg, a.device, a.seed)
    torch.cuda.synchronize()
    init_seconds = time.perf_counter() - t0
    if a.save:
        model.save_pretrained(a.save)
        print(json.dumps({"saved": os.path.abspath(a.save), "model": fields,
                          "init_seconds": init_seconds, "env": env}, indent=2))
        return 0
    out = {"benchmark": "hf_generate", "model": fields, "init_seconds": init_seconds,
           "dtype": "bfloat16", "repeat": a.repeat, "warmup_requests": 1}
    out.update(common)
    out["batches"] = speed(a, model, fields["vocab_size"])
    out["env"] = env
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
