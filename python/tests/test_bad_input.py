"""Bad input from a trainer: each a typed exception naming the tensor, nothing registered."""
import pytest
import torch

import refit
from refit.qwen3_moe import Config, Qwen3MoeForCausalLM

Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def host(recipe):
    h = refit.Host(recipe(world=2, tp=2, port=12345))
    h.register_rank(1, 2, "cpu:1")
    yield h
    h.close()


def rows(t, world=2, rank=1):
    begin, count = refit.fsdp_chunk(t.shape[0], world, rank)
    return t[begin:begin + count]


def test_wrong_dtype(host):
    with pytest.raises(refit.InvalidArgument) as e:
        host.register_tensor(Q, rows(torch.zeros(64, 64, dtype=torch.float32)), refit.SHARD0, (64, 64))
    assert e.value.where == Q
    assert "dtype float32, the model expects bfloat16" in str(e.value)
    with pytest.raises(refit.InvalidArgument, match="dtype torch.int64 is not bfloat16"):
        host.register_tensor(Q, torch.zeros(32, 64, dtype=torch.int64), refit.SHARD0, (64, 64))


def test_wrong_global_shape(host):
    with pytest.raises(refit.InvalidArgument) as e:
        host.register_tensor(Q, rows(torch.zeros(64, 63, dtype=torch.bfloat16)), refit.SHARD0, (64, 63))
    assert e.value.code == "invalid_argument" and e.value.where == Q
    assert "global shape [64, 63], the model expects [64, 64]" in e.value.message


def test_rows_that_are_not_this_ranks_fsdp2_chunk(host):
    with pytest.raises(refit.InvalidArgument, match=r"FSDP2's Shard\(0\) of 64 rows gives it \[32, 64\)"):
        host.register_tensor(Q, torch.zeros(31, 64, dtype=torch.bfloat16), refit.SHARD0, (64, 64))


def test_non_contiguous_tensor(host):
    t = torch.zeros(64, 32, dtype=torch.bfloat16).t()  # [32, 64], strides (1, 32)
    with pytest.raises(refit.InvalidArgument, match="is not contiguous") as e:
        host.register_tensor(Q, t, refit.SHARD0, (64, 64))
    assert e.value.where == Q


def test_tensor_on_the_wrong_device(host):
    with pytest.raises(refit.InvalidArgument, match="is on device meta") as e:
        host.register_tensor(Q, torch.zeros(32, 64, dtype=torch.bfloat16, device="meta"),
                             refit.SHARD0, (64, 64))
    assert e.value.where == Q


def test_extra_and_twice_registered_tensors(host):
    with pytest.raises(refit.InvalidArgument, match="extra tensor") as e:
        host.register_tensor("model.layers.0.mlp.shared_expert.weight",
                             torch.zeros(4, dtype=torch.bfloat16))
    assert e.value.where == "model.layers.0.mlp.shared_expert.weight"
    norm = torch.ones(64, dtype=torch.bfloat16)
    host.register_tensor("model.norm.weight", norm, refit.REPLICATED)
    with pytest.raises(refit.InvalidArgument, match="registered twice"):
        host.register_tensor("model.norm.weight", norm, refit.REPLICATED)


def test_missing_tensor_is_named_by_connect(recipe):
    h = refit.Host(recipe(world=1, tp=1, port=12345))
    h.register_rank(0, 1, "cpu:0")
    model = Qwen3MoeForCausalLM(Config(), seed=1)
    sd = model.state_dict()
    del sd["lm_head.weight"]
    h.register_module(sd)
    with pytest.raises(refit.InvalidArgument) as e:
        h.connect()  # checked before any connection is made
    assert e.value.where == "lm_head.weight"
    assert "missing tensor" in e.value.message
    h.close()


def test_name_map_mapping_two_parameters_to_one_name(recipe):
    h = refit.Host(recipe(world=1, tp=1, port=12345))
    h.register_rank(0, 1, "cpu:0")
    model = Qwen3MoeForCausalLM(Config(), seed=1)
    squash = {"model.norm.weight": "lm_head.weight"}
    with pytest.raises(refit.InvalidArgument) as e:
        h.register_module(model, name_map=squash)
    assert e.value.where == "lm_head.weight"
    assert "both model.norm.weight and lm_head.weight map to lm_head.weight" in e.value.message
    # A callable map: trainer names with a prefix, mapped back to HF names.
    wrapped = {"module." + k: v for k, v in model.state_dict().items()}
    h.register_module(wrapped, name_map=lambda k: k[len("module."):])
    h.close()


def test_tensor_resized_or_moved_after_registration(recipe):
    h = refit.Host(recipe(world=1, tp=1, port=12345))
    h.register_rank(0, 1, "cpu:0")
    model = Qwen3MoeForCausalLM(Config(), seed=1)
    h.register_module(model)
    h.check_tensors()  # unchanged: fine
    model.lm_head.weight.data = model.lm_head.weight.data[:128]  # same address, fewer bytes
    with pytest.raises(refit.InvalidArgument) as e:
        h.check_tensors()
    assert e.value.where == "lm_head.weight"
    assert "changed since registration" in e.value.message
    model.lm_head.weight.data = torch.zeros(256, 64, dtype=torch.bfloat16)  # moved
    with pytest.raises(refit.InvalidArgument, match="changed since registration"):
        h.check_tensors()
    h.close()


def test_typed_errors_carry_code_where_and_message():
    e = refit.errors.error_from("rank_lost", "rank 1", "gone")
    assert isinstance(e, refit.RankLost) and isinstance(e, refit.RefitError)
    assert (e.code, e.where, e.message) == ("rank_lost", "rank 1", "gone")
    assert str(e) == "refit.rank_lost at rank 1: gone"
    assert isinstance(refit.errors.error_from("verification_failed", "", "x"), refit.PublicationFailed)
    assert type(refit.errors.error_from("something_new", "", "x")) is refit.RefitError
