"""A small HF-compatible Qwen3-MoE in plain torch (torch 1.13 and later), with the parameter
names of transformers 5 (fused experts: mlp.experts.gate_up_proj [E, 2I, H], gate rows then
up rows; mlp.experts.down_proj [E, H, I]). Its forward is refit-runtime's math
(runtime/inference/torch_forward.cpp, in fp32 over the stored weights): RMSNorm, q/k norms,
rotate-half RoPE, grouped-query causal attention, softmax router with top-k (renormalized when
norm_topk_prob), SiLU-gated experts, untied lm_head. It serves as the trainer model of the
examples and for the log-probability parity checks."""
import math

import torch
from torch import nn


class Config:
    def __init__(self, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, vocab_size=256, rms_norm_eps=1e-6, rope_theta=1e6,
                 norm_topk_prob=True, torch_dtype=torch.bfloat16):
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.vocab_size = vocab_size
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.norm_topk_prob = norm_topk_prob
        self.torch_dtype = torch_dtype

    @classmethod
    def from_model_section(cls, m, base_dir="."):
        """From a recipe's `model:` mapping (HF config.json names), or the config.json of the
        checkpoint folder it names (`path`, relative to `base_dir`: the recipe's folder), with
        the mapping's own keys taking precedence."""
        import json
        import os
        fields = {}
        if "path" in m:
            with open(os.path.join(base_dir, m["path"], "config.json")) as f:
                fields.update(json.load(f))
            if "num_local_experts" in fields and "num_experts" not in fields:
                fields["num_experts"] = fields["num_local_experts"]
            if "rope_theta" not in fields and isinstance(fields.get("rope_parameters"), dict):
                fields["rope_theta"] = fields["rope_parameters"].get("rope_theta", 1e6)
            if "dtype" in fields and "torch_dtype" not in fields:
                fields["torch_dtype"] = fields["dtype"]
        fields.update(m)
        dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "vocab_size", "rms_norm_eps", "rope_theta", "norm_topk_prob")
        kw = {k: fields[k] for k in keys if k in fields}
        if "torch_dtype" in fields:
            kw["torch_dtype"] = dtypes[fields["torch_dtype"]]
        return cls(**kw)


class RMSNorm(nn.Module):
    def __init__(self, size, eps, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


def _linear(x, w):
    return torch.matmul(x, w.float().t())


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, h = c.head_dim, c.hidden_size
        self.q_proj = nn.Linear(h, c.num_attention_heads * d, bias=False, dtype=c.torch_dtype)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False, dtype=c.torch_dtype)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False, dtype=c.torch_dtype)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False, dtype=c.torch_dtype)
        self.q_norm = RMSNorm(d, c.rms_norm_eps, c.torch_dtype)
        self.k_norm = RMSNorm(d, c.rms_norm_eps, c.torch_dtype)
        self.c = c

    def forward(self, x, cos, sin):
        c, n = self.c, x.shape[0]
        q = _linear(x, self.q_proj.weight).view(n, c.num_attention_heads, c.head_dim)
        k = _linear(x, self.k_proj.weight).view(n, c.num_key_value_heads, c.head_dim)
        v = _linear(x, self.v_proj.weight).view(n, c.num_key_value_heads, c.head_dim)
        q = rope(self.q_norm(q), cos, sin)
        k = rope(self.k_norm(k), cos, sin)
        group = c.num_attention_heads // c.num_key_value_heads
        k = k.transpose(0, 1).repeat_interleave(group, 0)  # [heads, n, d]
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) / math.sqrt(c.head_dim)
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        ctx = torch.matmul(torch.softmax(scores, -1), v).transpose(0, 1).reshape(n, -1)
        return _linear(ctx, self.o_proj.weight)


class Experts(nn.Module):
    """transformers 5's fused expert parameters."""

    def __init__(self, c):
        super().__init__()
        e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=c.torch_dtype))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=c.torch_dtype))
        self.c = c


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = nn.Linear(c.hidden_size, c.num_experts, bias=False, dtype=c.torch_dtype)
        self.experts = Experts(c)
        self.c = c

    def forward(self, x):
        c = self.c
        probs = torch.softmax(_linear(x, self.gate.weight), -1)
        top_w, top_i = torch.topk(probs, c.num_experts_per_tok, -1)
        if c.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        inter = c.moe_intermediate_size
        for e in range(c.num_experts):
            rows, slot = torch.nonzero(top_i == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            gu = _linear(x[rows], self.experts.gate_up_proj[e])
            act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            y = _linear(act, self.experts.down_proj[e])
            out = out.index_add(0, rows, y * top_w[rows, slot].unsqueeze(1))
        return out


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MoE(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.torch_dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.torch_dtype)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=c.torch_dtype)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.torch_dtype)


def rope_tables(c, n):
    half = c.head_dim // 2
    inv = [1.0 / (float(c.rope_theta) ** (2 * i / c.head_dim)) for i in range(half)]
    inv = torch.tensor(inv, dtype=torch.float32)
    angle = torch.arange(n, dtype=torch.float32).unsqueeze(1) * inv.unsqueeze(0)
    return torch.cos(angle.double()).float().unsqueeze(1), torch.sin(angle.double()).float().unsqueeze(1)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class Qwen3MoeForCausalLM(nn.Module):
    """state_dict() names are the HF checkpoint names of transformers 5."""

    def __init__(self, c, seed=0, init_scale=0.02):
        super().__init__()
        self.config = c
        self.model = Body(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=c.torch_dtype)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * init_scale)

    def forward(self, tokens):
        """Logits [n, vocab] (fp32) of one sequence of token ids (a 1-d LongTensor)."""
        c = self.config
        x = self.model.embed_tokens.weight[tokens].float()
        cos, sin = rope_tables(c, tokens.shape[0])
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return _linear(self.model.norm(x), self.lm_head.weight)

    def token_logprobs(self, prompt, completion):
        """log p(completion[t] | prompt + completion[:t]) for every t, under T = 1 (fp32)."""
        tokens = torch.tensor(list(prompt) + list(completion[:-1]), dtype=torch.long)
        logits = self.forward(tokens)[len(prompt) - 1:]
        lp = torch.log_softmax(logits, -1)
        return lp.gather(1, torch.tensor(list(completion), dtype=torch.long).unsqueeze(1)).squeeze(1)
