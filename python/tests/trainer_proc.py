"""A trainer process of the Python tests: a plain-torch Qwen3-MoE replica (same seed on every
rank, one intra-op thread: every rank computes bit-identical updates), whose FSDP2 Shard(0)
rows of every parameter this rank registers (row views of the parameters: zero copy). Per
step: generate from the runtime, a policy-gradient loss on the sampled tokens' log-probs
under the trainer's own forward, an AdamW step (in place), publish, and the parity of the
runtime's log-probabilities with the trainer's forward on the published weights.

    trainer_proc.py RECIPE RANK WORLD PORT STEPS GLOO_PORT
Rank 0 generates and broadcasts the samples over a gloo process group (a rank's generate
while another rank already waits at the next publish's barrier would be refused with
PublicationOpen). Prints one JSON object per event."""
import json
import sys

import torch
import torch.distributed as dist

import refit
from refit.qwen3_moe import Config, Qwen3MoeForCausalLM


def emit(**kw):
    print(json.dumps(kw), flush=True)


def shard_rows(t, world, rank):
    begin, count = refit.fsdp_chunk(t.shape[0], world, rank)
    return t.data[begin:begin + count]  # a view of the parameter's own storage


def main():
    recipe, rank, world, port, steps, gloo = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                              int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % gloo, rank=rank,
                                world_size=world)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Config(), seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    host = refit.Host(recipe, coordinator_port=port or None)
    host.register_rank(rank, world, "cpu:%d" % rank)
    replicated = {"model.norm.weight"}  # one tensor every rank holds whole
    for name, p in model.state_dict(keep_vars=True).items():
        if name in replicated:
            host.register_tensor(name, p.data, placement=refit.REPLICATED)
        else:
            host.register_tensor(name, shard_rows(p, world, rank), placement=refit.SHARD0,
                                 global_shape=tuple(p.shape))
    host.connect()
    emit(event="connected", rank=rank)
    prompts = ["The quick brown fox", "refit publishes"]
    version = 0
    for step in range(steps + 1):
        if step > 0:
            # Policy gradient on the last samples: reward = fraction of lowercase letters.
            opt.zero_grad()
            loss = 0.0
            for s in samples:
                lp = model.token_logprobs(s.prompt_token_ids, s.token_ids)
                reward = sum(1.0 for t in s.token_ids if 97 <= t <= 122) / len(s.token_ids)
                loss = loss - (reward - 0.1) * lp.sum()
            (loss / len(samples)).backward()
            opt.step()
            host.step()
        version += 1
        emit(event="publishing", version=version)
        pub = host.publish(version)
        box = [host.generate(prompts, n=2, max_tokens=8, temperature=1.0, seed=step)
               if rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        samples = box[0]
        worst = 0.0
        with torch.no_grad():
            for s in samples:
                mine = model.token_logprobs(s.prompt_token_ids, s.token_ids)
                worst = max(worst, float((mine - torch.tensor(s.logprobs)).abs().max()))
        emit(event="published", version=pub.model_version, tensors=pub.tensors, tp=pub.tp,
             receipts=pub.receipts, sample_versions=sorted({s.model_version for s in samples}),
             parity=worst, samples=[s.token_ids for s in samples],
             checksum=float(sum(p.float().sum() for p in model.parameters())))
    host.close()
    emit(event="done")


if __name__ == "__main__":
    try:
        main()
    except refit.RefitError as e:
        emit(event="error", type=type(e).__name__, code=e.code, where=e.where, message=e.message)
        sys.exit(3)
