"""Weights between Hugging Face (Qwen3) names and megatron-core GPTModel shards, both ways.

Hugging Face -> Megatron initialises the trainer (each tensor-parallel rank takes its shard);
Megatron -> Hugging Face gathers the shards for the sync stage, exports and checkpoints.
megatron-bridge (NVIDIA-NeMo/Megatron-Bridge) does this, but it needs Transformer Engine,
CUDA and transformers < 5, none of which this project can require, and megatron-core itself
has no converter: so it is written here, by name, from megatron-core's own layouts
(/work/shared/megatron-notes.md gives the sources):

- `linear_qkv` fuses q, k and v per KV group g: [the P = heads/groups query heads of g; k_g;
  v_g]. Tensor parallelism cuts it on dim 0 into whole groups, so each shard is the fused
  layout of its own groups. A plain cat([q, k, v]) is wrong even at TP=1.
- `linear_fc1` is cat([gate, up]); under TP each rank holds [gate_r; up_r] (partition stride 2),
  so gate and up are cut separately. A plain dim-0 chunk of the fused tensor is wrong.
- Column-parallel weights (embedding, output layer) split dim 0; row-parallel ones (o_proj,
  down_proj) split dim 1; norms (incl. q/k norm) are replicated.
- Tied embeddings: the output layer has no weight of its own.
- PPO's critic (`critic=True`): the policy's trunk under Hugging Face names `trunk.*` (core/critic.py's ValueModel:
  the decoder's names without `model.`), and its value head `head.weight` [1, hidden] and `head.bias` [1] as the
  output layer's weight and bias, replicated (slime's LinearForLastLayer is a plain Linear on every TP rank).
- Transformer Engine's spec fuses the pre-attention and pre-MLP norms into linear_qkv and
  linear_fc1 (`layer_norm_weight`); the local spec keeps them as modules of their own.

No vocabulary padding: the vocabulary must divide by TP (model.py checks), so the two sides'
logits agree column for column.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from rlbench.backends.megatron import faults

REPLICATED, ROWS, COLS, QKV, GATE_UP = "replicated", "rows", "cols", "qkv", "gate_up"


@dataclass(frozen=True)
class Dims:
    """The model's shape as the conversion needs it (from the Hugging Face config)."""

    layers: int
    hidden: int
    heads: int
    groups: int  # KV heads
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    te_names: bool = False  # Transformer Engine spec: the two pre-norms live inside linear_qkv / linear_fc1

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Param:
    megatron: str
    hf: tuple[str, ...]
    kind: str


def params(dims: Dims, critic: bool = False) -> list[Param]:
    """Every Megatron parameter with its Hugging Face source(s), in Hugging Face's parameter order; `critic`: PPO's
    critic's (the trunk as `trunk.*`, the value head as the output layer)."""
    if critic:
        trunk = [
            Param(p.megatron, tuple(f"trunk.{h.removeprefix('model.')}" for h in p.hf), p.kind) for p in params(dims)
        ]
        head = [Param(f"output_layer.{x}", (f"head.{x}",), REPLICATED) for x in ("weight", "bias")]
        return [p for p in trunk if p.megatron != "output_layer.weight"] + head
    out = [Param("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), ROWS)]
    for i in range(dims.layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn_norm = m + ("self_attention.linear_qkv.layer_norm_weight" if dims.te_names else "input_layernorm.weight")
        mlp_norm = m + ("mlp.linear_fc1.layer_norm_weight" if dims.te_names else "pre_mlp_layernorm.weight")
        out += [
            Param(m + "self_attention.linear_qkv.weight", tuple(f"{h}self_attn.{x}_proj.weight" for x in "qkv"), QKV),
            Param(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), COLS),
            Param(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), REPLICATED),
            Param(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), REPLICATED),
            Param(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), GATE_UP),
            Param(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), COLS),
            Param(attn_norm, (h + "input_layernorm.weight",), REPLICATED),
            Param(mlp_norm, (h + "post_attention_layernorm.weight",), REPLICATED),
        ]
    out.append(Param("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
    if not dims.tied:
        out.append(Param("output_layer.weight", ("lm_head.weight",), ROWS))
    return out


def hf_names(dims: Dims, critic: bool = False) -> list[str]:
    return [name for p in params(dims, critic) for name in p.hf]


def _qkv_groups(dims: Dims, qkv: torch.Tensor) -> torch.Tensor:
    """A fused QKV weight (whole, or a shard of whole groups) as [groups, P + 2, head_dim, hidden]."""
    per_group = dims.heads // dims.groups
    return qkv.view(-1, per_group + 2, dims.head_dim, dims.hidden)


def fuse_qkv(dims: Dims, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    per_group = dims.heads // dims.groups
    fused = torch.cat(
        [
            q.view(dims.groups, per_group * dims.head_dim, dims.hidden),
            k.view(dims.groups, dims.head_dim, dims.hidden),
            v.view(dims.groups, dims.head_dim, dims.hidden),
        ],
        dim=1,
    )
    return fused.chunk(tp, dim=0)[rank].reshape(-1, dims.hidden)


def split_qkv(dims: Dims, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole fused QKV weight (shards concatenated on dim 0) back into q, k and v."""
    t = _qkv_groups(dims, qkv)
    per_group = dims.heads // dims.groups
    q = t[:, :per_group].reshape(-1, dims.hidden)
    k, v = t[:, per_group].reshape(-1, dims.hidden), t[:, per_group + 1].reshape(-1, dims.hidden)
    if faults.active("swap-kv-split"):
        k, v = v, k
    return q, k, v


def to_megatron(
    hf: Mapping[str, torch.Tensor], dims: Dims, tp: int = 1, rank: int = 0, critic: bool = False
) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank `rank`'s shard of every Megatron parameter, from full Hugging Face weights."""
    out = {}
    for p in params(dims, critic):
        src = [hf[name] for name in p.hf]
        if p.kind == REPLICATED:
            t = src[0]
        elif p.kind == ROWS:
            t = src[0].chunk(tp, dim=0)[rank]
        elif p.kind == COLS:
            t = src[0].chunk(tp, dim=1)[rank]
        elif p.kind == QKV:
            t = fuse_qkv(dims, *src, tp, rank)
        else:  # GATE_UP
            t = torch.cat([src[0].chunk(tp, dim=0)[rank], src[1].chunk(tp, dim=0)[rank]])
        out[p.megatron] = t.detach().clone().contiguous()
    return out


def to_hf(shards: Sequence[Mapping[str, torch.Tensor]], dims: Dims, critic: bool = False) -> dict[str, torch.Tensor]:
    """Full Hugging Face weights (in Hugging Face's order) from every tensor-parallel rank's shard, rank order."""
    out = {}
    for p in params(dims, critic):
        parts = [s[p.megatron] for s in shards]
        if p.kind == REPLICATED:
            tensors = (parts[0],)
        elif p.kind == ROWS:
            tensors = (torch.cat(parts, dim=0),)
        elif p.kind == COLS:
            tensors = (torch.cat(parts, dim=1),)
        elif p.kind == QKV:
            tensors = split_qkv(dims, torch.cat(parts, dim=0))
        else:  # GATE_UP
            halves = [t.chunk(2, dim=0) for t in parts]
            tensors = (torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves]))
        for name, t in zip(p.hf, tensors):
            out[name] = t.detach().clone().contiguous()
    return out
