#!/usr/bin/env python3
"""Writes a Qwen3-MoE checkpoint directory of the Qwen3-30B-A3B layer shape with random bf16
weights (per-expert keys, as transformers 5.17's save_pretrained writes them), sharded, with a
config.json HF reads and a given tokenizer: the input of the GPU load benchmark (bench/gpu-load.sh).

  python3 bench/make_checkpoint.py OUT_DIR --layers 3 --tokenizer DIR

Needs torch and safetensors (the GPU machine has both)."""
import argparse, json, os, shutil
import torch
from safetensors.torch import save_file

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--layers", type=int, default=3)
p.add_argument("--tokenizer", required=True, help="dir with tokenizer.json, tokenizer_config.json")
p.add_argument("--shard-bytes", type=int, default=2 << 30)
a = p.parse_args()

H, heads, kv, hd, E, k, I, V = 2048, 32, 4, 128, 128, 8, 768, 151936
cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
       "num_hidden_layers": a.layers, "num_attention_heads": heads, "num_key_value_heads": kv,
       "head_dim": hd, "num_experts": E, "num_experts_per_tok": k, "moe_intermediate_size": I,
       "intermediate_size": 6144, "vocab_size": V, "tie_word_embeddings": False,
       "rms_norm_eps": 1e-6, "rope_theta": 1e6, "norm_topk_prob": True, "dtype": "bfloat16",
       "hidden_act": "silu", "attention_bias": False, "decoder_sparse_step": 1,
       "mlp_only_layers": [], "max_position_embeddings": 40960, "use_sliding_window": False,
       "sliding_window": None, "bos_token_id": 151643, "eos_token_id": 151645}
os.makedirs(a.out, exist_ok=True)
g = torch.Generator().manual_seed(0)

def w(*shape, scale=0.02):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

def norm(n):
    return (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

tensors = [("model.embed_tokens.weight", lambda: w(V, H))]
for i in range(a.layers):
    L = f"model.layers.{i}."
    tensors += [(L + "self_attn.q_proj.weight", lambda: w(heads * hd, H)),
                (L + "self_attn.k_proj.weight", lambda: w(kv * hd, H)),
                (L + "self_attn.v_proj.weight", lambda: w(kv * hd, H)),
                (L + "self_attn.o_proj.weight", lambda: w(H, heads * hd)),
                (L + "self_attn.q_norm.weight", lambda: norm(hd)),
                (L + "self_attn.k_norm.weight", lambda: norm(hd)),
                (L + "mlp.gate.weight", lambda: w(E, H, scale=0.1))]
    for e in range(E):
        tensors += [(L + f"mlp.experts.{e}.gate_proj.weight", lambda: w(I, H)),
                    (L + f"mlp.experts.{e}.up_proj.weight", lambda: w(I, H)),
                    (L + f"mlp.experts.{e}.down_proj.weight", lambda: w(H, I))]
    tensors += [(L + "input_layernorm.weight", lambda: norm(H)),
                (L + "post_attention_layernorm.weight", lambda: norm(H))]
tensors += [("model.norm.weight", lambda: norm(H)), ("lm_head.weight", lambda: w(V, H))]

shards, cur, size = [], {}, 0
for name, make in tensors:
    t = make()
    if cur and size + t.numel() * 2 > a.shard_bytes:
        shards.append(cur); cur, size = {}, 0
    cur[name] = t; size += t.numel() * 2
shards.append(cur)
weight_map, total = {}, 0
for n, shard in enumerate(shards):
    fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(a.out, fname), metadata={"format": "pt"})
    for name, t in shard.items():
        weight_map[name] = fname; total += t.numel() * 2
json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
          open(os.path.join(a.out, "model.safetensors.index.json"), "w"), indent=2)
json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)
json.dump({"eos_token_id": 151645, "pad_token_id": 151643},
          open(os.path.join(a.out, "generation_config.json"), "w"))
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(a.tokenizer, f), os.path.join(a.out, f))
print(json.dumps({"dir": a.out, "tensors": len(tensors), "bytes": total, "shards": len(shards)}))
