"""Hugging Face <-> megatron-core conversion (rlbench/backends/megatron/convert.py): the converted
GPTModel computes the transformers model's logits, the round trip is bit-identical, and under
TP=2 each shard holds whole KV groups of QKV and its own halves of gate and up."""

from __future__ import annotations

import pytest
import torch

from rlbench.backends.megatron import convert, faults
from rlbench.backends.megatron import model as mmodel
from rlbench.config_sections import FIXTURES
from rlbench.core.model import build_model, load_model_config, named_weights

MODEL = FIXTURES / "models" / "tiny-qwen3"


@pytest.fixture(scope="module")
def hf():
    return build_model(MODEL, master_seed=7, init="random")


@pytest.fixture(scope="module")
def dims():
    return mmodel.dims_of(load_model_config(MODEL), 2, MODEL)


def test_parameter_order_is_the_hf_models(hf, dims):
    assert convert.hf_names(dims) == [name for name, _ in hf.named_parameters()]


def test_megatron_logits_equal_the_hf_models(hf, dims, one_rank):
    config = load_model_config(MODEL)
    tconfig = mmodel.transformer_config(config, dims, 1, False, "cpu", {})
    gpt = mmodel.build(config, dims, tconfig)
    gpt.load_state_dict(convert.to_megatron(named_weights(hf), dims), strict=True)
    ids = torch.randint(0, dims.vocab, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = mmodel.logits(gpt, ids), hf(input_ids=ids).logits
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < 1e-5  # fp32, other kernels: measured 1.8e-7
    # Megatron -> HF of the model's own parameters: the weights it was given, bit for bit.
    back = convert.to_hf([{n: p for n, p in gpt.named_parameters()}], dims)
    assert list(back) == list(named_weights(hf))
    assert all(torch.equal(back[n], t) for n, t in named_weights(hf).items())


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_bit_identical(hf, dims, tp):
    weights = named_weights(hf)
    shards = [convert.to_megatron(weights, dims, tp, rank) for rank in range(tp)]
    back = convert.to_hf(shards, dims)
    assert list(back) == list(weights)
    for name, tensor in weights.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_tp_shards_hold_whole_groups_and_their_own_gate_and_up(hf, dims):
    weights = named_weights(hf)
    whole = convert.to_megatron(weights, dims)
    shards = [convert.to_megatron(weights, dims, 2, rank) for rank in range(2)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    rows = whole[qkv].shape[0] // 2  # one KV group of two: [q heads 2r, 2r+1; k_r; v_r]
    for rank in range(2):
        assert torch.equal(shards[rank][qkv], whole[qkv][rank * rows : (rank + 1) * rows])
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    k = weights["model.layers.0.self_attn.k_proj.weight"]
    d = dims.head_dim
    assert torch.equal(shards[1][qkv][: 2 * d], q[2 * d : 4 * d])  # heads 2 and 3
    assert torch.equal(shards[1][qkv][2 * d : 3 * d], k[d : 2 * d])  # the second KV head
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = weights["model.layers.0.mlp.gate_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"]
    half = dims.ffn // 2
    assert torch.equal(shards[1][fc1], torch.cat([gate[half:], up[half:]]))
    assert not torch.equal(shards[1][fc1], whole[fc1].chunk(2)[1])  # a plain chunk would be all of up


def test_the_swap_fault_breaks_the_split(hf, dims, monkeypatch):
    weights = named_weights(hf)
    monkeypatch.setenv(faults.ENV, "swap-kv-split")
    back = convert.to_hf([convert.to_megatron(weights, dims)], dims)
    assert torch.equal(
        back["model.layers.0.self_attn.v_proj.weight"], weights["model.layers.0.self_attn.k_proj.weight"]
    )
    monkeypatch.setenv(faults.ENV, "no-such-fault")
    with pytest.raises(ValueError, match="unknown fault"):
        faults.active("swap-kv-split")


def test_transformer_engine_names(dims):
    from dataclasses import replace

    names = {p.megatron for p in convert.params(replace(dims, te_names=True))}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.layers.0.input_layernorm.weight" not in names
