"""FSDP2 DTensors are read through to_local() and their placements. torch 1.13 has no DTensor,
so these stand-ins have exactly the attributes refit reads (placements, to_local, device_mesh,
shape): Shard(0) rows become this rank's FSDP2 chunk, Replicate() the whole tensor."""
import pytest
import torch

import refit
from refit.qwen3_moe import Config, Qwen3MoeForCausalLM

from conftest import free_port


class Placement:
    def __init__(self, kind, dim=None):
        self.kind, self.dim = kind, dim

    def is_shard(self):
        return self.kind == "shard"

    def is_replicate(self):
        return self.kind == "replicate"

    def __repr__(self):
        return "Shard(%d)" % self.dim if self.kind == "shard" else "Replicate()"


class FakeDTensor:
    device_mesh = object()

    def __init__(self, full, world, rank, placement):
        self.shape = full.shape
        self.placements = (placement,)
        if placement.is_shard() and placement.dim == 0:
            begin, count = refit.fsdp_chunk(full.shape[0], world, rank)
            self._local = full[begin:begin + count].clone()
        elif placement.is_shard():
            self._local = full.chunk(world, placement.dim)[rank].contiguous()
        else:
            self._local = full.clone()

    def to_local(self):
        return self._local


def test_a_sharded_module_of_dtensors_registers_and_seals(recipe):
    world, rank = 4, 3  # the last rank: one expert of four, 1 of 4 q heads' rows, ...
    h = refit.Host(recipe(world=4, tp=4, port=free_port(), join_timeout_ms=300))
    h.register_rank(rank, world, "cpu:0")
    model = Qwen3MoeForCausalLM(Config(), seed=1)
    sd = {}
    for name, p in model.state_dict().items():
        placement = Placement("replicate") if name.endswith("norm.weight") else Placement("shard", 0)
        sd[name] = FakeDTensor(p, world, rank, placement)
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].to_local().shape[0] == 1
    h.register_module(sd)
    with pytest.raises(refit.RefitError) as e:
        h.connect()  # the set is complete: connect gets past the seal to the network
    assert e.value.code == "coordinator_unreachable", e.value
    h.close()


def test_other_placements_are_refused_by_name(recipe):
    h = refit.Host(recipe(world=2, tp=2, port=12345))
    h.register_rank(0, 2, "cpu:0")
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(refit.InvalidArgument, match=r"Shard\(1\) is neither Shard\(0\) nor Replicate") as e:
        h.register_tensor("model.layers.0.self_attn.q_proj.weight", FakeDTensor(w, 2, 0, Placement("shard", 1)))
    assert e.value.where == "model.layers.0.self_attn.q_proj.weight"
    h.close()
