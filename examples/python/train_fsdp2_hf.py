#!/usr/bin/env python3
"""FSDP2 over HF transformers' Qwen3MoeForCausalLM, published from the GPU through refit.

    torchrun --nproc-per-node 1 train_fsdp2_hf.py --out result.json [--steps K]

Each rank (one GPU per process; world 1 is what refit's GPU path supports so far) builds a
tiny Qwen3-MoE with transformers, wraps every decoder layer and the model in FSDP2
`fully_shard`, registers the module's DTensor parameters with refit (Shard(0) local shards,
transformers 5's fused experts, read in place from GPU memory), takes K real AdamW steps on
a policy-gradient loss over the runtime's own samples, publishes every step through CUDA IPC
into refit-runtime (the coordinator embedded in rank 0: serve.embedded), and compares the
runtime's log-probabilities of the sampled tokens with the HF model's own forward (bf16
tolerance: the HF forward runs in bf16, refit-runtime in fp32 over the same bf16 weights).
Writes the measurements as JSON to --out. Needs the refit package, $REFIT_LIBRARY of a
REFIT_CUDA=ON build and $REFIT_RUNTIME (its refit-runtime)."""
import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import refit


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def write_recipe(path, hf, world, runtime, port):
    rope_theta = getattr(hf, "rope_theta", None)
    if rope_theta is None:
        rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 1e6)
    model = ("{model_type: qwen3_moe, num_hidden_layers: %d, hidden_size: %d, num_attention_heads: %d, "
             "num_key_value_heads: %d, head_dim: %d, num_experts: %d, num_experts_per_tok: %d, "
             "moe_intermediate_size: %d, vocab_size: %d, tie_word_embeddings: false, "
             "rms_norm_eps: %r, rope_theta: %r, norm_topk_prob: %s, torch_dtype: bfloat16}"
             % (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
                hf.head_dim, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
                hf.vocab_size, float(hf.rms_norm_eps), float(rope_theta),
                "true" if hf.norm_topk_prob else "false"))
    devices = ", ".join("cuda:%d" % r for r in range(world))
    with open(path, "w") as f:
        f.write("model: %s\n" % model)
        f.write("runtime: {executable: %s, tp_size: %d, devices: [%s], kv_cache_bytes: 67108864}\n"
                % (runtime, world, devices))
        f.write("publication: {buffer_bytes: 1048576, buffer_count: 2, verify: true, transport: cuda_ipc}\n")
        f.write("serve: {host: 127.0.0.1, port: %d, token_env: REFIT_TOKEN, world_size: %d, embedded: true}\n"
                % (port, world))


def hf_logprobs(model, prompt, completion):
    ids = torch.tensor([list(prompt) + list(completion[:-1])], device="cuda")
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:].float()
    lp = torch.log_softmax(logits, -1)
    return lp.gather(1, torch.tensor(completion, device="cuda").unsqueeze(1)).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    torch.manual_seed(0)
    hf = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, max_position_embeddings=256, decoder_sparse_step=1,
                        mlp_only_layers=[])
    model = Qwen3MoeForCausalLM(hf).to(device="cuda", dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    os.environ.setdefault("REFIT_TOKEN", "refit-fsdp2-example-secret-0123456789")
    recipe = os.path.join(os.path.dirname(os.path.abspath(args.out)), "fsdp2-recipe.yaml")
    if rank == 0:
        write_recipe(recipe, hf, world, os.environ["REFIT_RUNTIME"], free_port())
    dist.barrier()
    host = refit.Host(recipe)
    host.register_rank(rank, world, "cuda:%d" % local)
    kinds = {}
    for name, p in model.state_dict(keep_vars=True).items():
        kinds[name] = type(p).__name__ + str(tuple(getattr(p, "placements", ())))
    host.register_module(model)
    host.connect()

    prompts = ["The quick brown fox", "FSDP2 publishes through refit"]
    report = {"world": world, "steps": [], "tensor_types": sorted(set(kinds.values()))}
    for step in range(args.steps + 1):
        t0 = time.time()
        pub = host.publish(step + 1)
        wall = time.time() - t0
        samples = host.generate(prompts, n=2, max_tokens=12, temperature=1.0, seed=step)
        diffs = []
        with torch.no_grad():
            for s in samples:
                mine = hf_logprobs(model, s.prompt_token_ids, s.token_ids)
                diffs.extend((mine - torch.tensor(s.logprobs, device="cuda")).abs().tolist())
        report["steps"].append({"version": pub.model_version, "tensors": pub.tensors, "bytes": pub.bytes,
                                "seconds": pub.seconds, "publish_wall_seconds": wall,
                                "sample_versions": sorted({s.model_version for s in samples}),
                                "max_abs_logprob_diff": max(diffs),
                                "mean_abs_logprob_diff": sum(diffs) / len(diffs),
                                "checksums": len(pub.receipts[0])})
        print(json.dumps(report["steps"][-1]), flush=True)
        if step == args.steps:
            break
        opt.zero_grad()
        loss = 0.0
        for s in samples:
            lp = hf_logprobs(model, s.prompt_token_ids, s.token_ids)
            reward = sum(1.0 for t in s.token_ids if 97 <= t <= 122) / len(s.token_ids)
            loss = loss - (reward - 0.2) * lp.sum()
        (loss / len(samples)).backward()
        opt.step()
        host.step()
    try:
        host.check_tensors()
        report["registered_memory_stable"] = True
    except refit.RefitError as e:
        report["registered_memory_stable"] = str(e)
    host.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
