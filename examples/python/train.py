#!/usr/bin/env python3
"""A real training loop published through refit, on CPU: a small HF-compatible Qwen3-MoE in
plain torch (refit.qwen3_moe, transformers 5 names), real AdamW steps on a policy-gradient
loss over the runtime's own samples, every step published, and the check that the runtime's
log-probabilities of the sampled tokens equal the trainer's forward on the same weights.

One process (world 1, the coordinator embedded in it, serve.embedded in the recipe):
    REFIT_TOKEN=... python3 train.py --config recipe.yaml --steps 5
Several processes (torchrun-style: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, CPU gloo
for the samples; each rank registers its FSDP2 Shard(0) rows of every parameter), next to
`refit-coordinator serve -c recipe.yaml --port 7400`:
    torchrun --nproc-per-node 2 train.py --config recipe.yaml --port 7400 --steps 5
Needs the refit package (pip install ./python) and librefit.so ($REFIT_LIBRARY)."""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import yaml

import refit
from refit.qwen3_moe import Config, Qwen3MoeForCausalLM


def reward(tokens):
    """A toy reward: the fraction of sampled bytes that are lowercase letters."""
    return sum(1.0 for t in tokens if 97 <= t <= 122) / max(1, len(tokens))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the recipe shared with the coordinator")
    ap.add_argument("--port", type=int, default=None, help="the coordinator's port (serve.port)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--tolerance", type=float, default=2e-3, help="log-probability parity bound")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)  # every rank computes bit-identical updates of its replica
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    with open(args.config) as f:
        cfg = Config.from_model_section(yaml.safe_load(f)["model"],
                                        os.path.dirname(os.path.abspath(args.config)))
    model = Qwen3MoeForCausalLM(cfg, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    host = refit.Host(args.config, coordinator_port=args.port)
    host.register_rank(rank, world, "cpu:%d" % rank)
    if world == 1:
        host.register_module(model)
    else:  # this rank's FSDP2 Shard(0) rows: views of the parameters (zero copy)
        for name, p in model.state_dict(keep_vars=True).items():
            begin, count = refit.fsdp_chunk(p.shape[0], world, rank)
            host.register_tensor(name, p.data[begin:begin + count], refit.SHARD0, tuple(p.shape))
    host.connect()

    prompts = ["The quick brown fox", "colocated RL publishes weights"]
    for step in range(args.steps + 1):
        pub = host.publish(step + 1)
        box = [host.generate(prompts, n=4, max_tokens=16, temperature=1.0, seed=step)
               if rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        samples = box[0]
        with torch.no_grad():
            parity = max(float((model.token_logprobs(s.prompt_token_ids, s.token_ids)
                                - torch.tensor(s.logprobs)).abs().max()) for s in samples)
        mean_reward = sum(reward(s.token_ids) for s in samples) / len(samples)
        if rank == 0:
            print("step %d: version %d (%d tensors, %.2f ms), reward %.3f, parity %.2e"
                  % (step, pub.model_version, pub.tensors, pub.seconds * 1e3, mean_reward, parity),
                  flush=True)
        if parity > args.tolerance:
            print("parity %.3e exceeds %.1e" % (parity, args.tolerance), file=sys.stderr)
            return 1
        if step == args.steps:
            break
        opt.zero_grad()
        loss = 0.0
        for s in samples:
            lp = model.token_logprobs(s.prompt_token_ids, s.token_ids)
            loss = loss - (reward(s.token_ids) - mean_reward) * lp.sum()
        (loss / len(samples)).backward()
        opt.step()
        host.step()
    host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
