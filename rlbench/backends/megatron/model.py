"""A megatron-core GPTModel equal to the fixture's transformers model (Qwen3).

The TransformerConfig is made from the Hugging Face config: RMSNorm, SwiGLU, GQA, q/k norm, RoPE,
tied embeddings as the model has them, no dropout, no biases. These fields are rlbench's (they
say what the model is); every other TransformerConfig field can be set in the `[train.megatron]`
table, which passes through unchanged (slime's convention: Megatron's own arguments are not
redeclared), its keys, types and precision checked first (settings.py; `check` runs every check
before any rank process starts). The local layer spec is used unless Transformer Engine is
installed and a GPU trains.

The logits are gathered over tensor-parallel ranks (`parallel_output=False`), so the loss, the
log-probs and the entropy are the torch trainer's own functions (rlbench/core/algo.py) on the
full vocabulary: the two trainers differ only in the model.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from rlbench.backends.megatron import settings
from rlbench.backends.megatron.convert import Dims
from rlbench.backends.megatron.settings import has_transformer_engine
from rlbench.errors import BadInput

SUPPORTED = ("qwen3",)


@contextmanager
def quiet():
    """megatron-core warns, once per rank, that Apex and Transformer Engine are absent and about
    defaults rlbench does not use (cuda_graph_scope): not the user's concern, so not on stderr. Its import
    runs here too (every rlbench import of megatron-core is inside this), with `torch.compile` deferred."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        with _compile_on_first_call():
            yield


@contextmanager
def _compile_on_first_call():
    """While megatron-core is first imported: `torch.compile` on a function gives a function that compiles it
    when first called. megatron-core decorates its fused kernels with torch.compile as it is imported
    (megatron/core/jit.py), and torch.compile imports TorchInductor's compiler for that, ~1.2 s of every rank
    process's start, though a compiled function compiles on its first call either way. Anything but a plain
    function (a module) goes to torch.compile itself."""
    import functools
    import inspect
    import sys

    if "megatron.core" in sys.modules:
        yield
        return
    compile_now = torch.compile

    def compile_later(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):
            return compile_now(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = compile_later
    try:
        yield
    finally:
        torch.compile = compile_now


def silence_runtime_warnings() -> None:
    """For the life of a rank process: megatron-core's forward calls a torch collective that torch
    deprecates, and under TP it advises CUDA_DEVICE_MAX_CONNECTIONS=1, a speed setting for
    overlapping communication that rlbench's small models do not need."""
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS", category=UserWarning)


def dims_of(hf_config, tp: int, source: str | Path, device: str = "cpu") -> Dims:
    """The model's shape, refused (BadInput) where this converter or the TP size cannot take it.
    Transformer Engine's layer spec (and its parameter names) where it is installed and a GPU trains."""
    where = Path(source) / "config.json"
    if hf_config.model_type not in SUPPORTED:
        raise BadInput(
            f"the megatron trainer converts {', '.join(SUPPORTED)} models, not {hf_config.model_type!r}",
            path=where,
            field="model_type",
        )
    if getattr(hf_config, "attention_bias", False):
        raise BadInput("attention biases are not converted", path=where, field="attention_bias")
    dims = Dims(
        layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        heads=hf_config.num_attention_heads,
        groups=hf_config.num_key_value_heads,
        head_dim=hf_config.head_dim,
        ffn=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
        tied=bool(hf_config.tie_word_embeddings),
        te_names=device.startswith("cuda") and has_transformer_engine(),
    )
    for key, value in (
        ("num_key_value_heads", dims.groups),
        ("intermediate_size", dims.ffn),
        ("vocab_size", dims.vocab),
    ):
        if value % tp:
            raise BadInput(f"{value} does not divide by the tensor-parallel size {tp}", path=where, field=key)
    return dims


RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def overrides_of(train) -> dict:
    """The TransformerConfig fields a run's train section sets: the `[train.megatron]` table, and with
    `train.recompute` megatron-core's full recompute of every layer (slime's --recompute-granularity full
    --recompute-method uniform --recompute-num-layers 1), which the table may not set besides."""
    if not train.recompute:
        return dict(train.megatron)
    both = sorted(set(train.megatron) & set(RECOMPUTE))
    if both:
        raise BadInput(f"{both[0]} is set by train.recompute, not here", field=f"train.megatron.{both[0]}")
    return {**train.megatron, **RECOMPUTE}


def check(config) -> None:
    """Every megatron setting of a trainer's setup (config.TrainerSetup), before any rank process starts
    (BadInput at the first problem): the model's shape against TP (`dims_of`), the `[train.megatron]` table's
    keys, types and precision (settings.py), and megatron-core's own checks of the whole TransformerConfig (by
    making it)."""
    from rlbench.core.model import load_model_config

    hf_config = load_model_config(config.model.path)
    dims = dims_of(hf_config, config.tp, config.model.path, config.device)
    transformer_config(
        hf_config, dims, config.tp, config.deterministic, config.device, overrides_of(config.train), config.model.dtype
    )


def transformer_config(
    hf_config, dims: Dims, tp: int, deterministic: bool, device: str, overrides: dict, dtype: str = "float32"
):
    """The rank's TransformerConfig: the model's fields and rlbench's (OWNED), then `overrides` (the
    `[train.megatron]` table), checked first by settings.check_table. `dtype`: the run's model.dtype,
    its parameters' dtype (float32, bfloat16, or float64 on the CPU: config.py allows no other here); bfloat16
    sets megatron-core's `bf16` too, as Megatron's mixed precision does (the trainer keeps fp32 masters)."""
    with quiet():
        from megatron.core.transformer.transformer_config import TransformerConfig
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    settings.check_table(overrides, fields, typing.get_type_hints(TransformerConfig), device)
    owned = dict(
        num_layers=dims.layers,
        hidden_size=dims.hidden,
        num_attention_heads=dims.heads,
        num_query_groups=dims.groups,
        kv_channels=dims.head_dim,
        ffn_hidden_size=dims.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=float(hf_config.attention_dropout),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        params_dtype=getattr(torch, dtype),
        use_cpu_initialization=device == "cpu",
        # The loss is already normalised over the whole minibatch, so data-parallel
        # gradients must be summed, not averaged (Megatron's DDP scales by 1/dp otherwise).
        calculate_per_token_loss=True,
        # deterministic kernels (an embedding backward without atomics) where --deterministic
        # asks for them: on a GPU; the CPU is deterministic either way
        deterministic_mode=deterministic and device.startswith("cuda"),
    )
    if dtype == "bfloat16":
        if "bf16" in overrides:
            raise BadInput('set by model.dtype = "bfloat16", not here', field="train.megatron.bf16")
        owned["bf16"] = True
    try:
        with quiet():
            return TransformerConfig(**owned, **overrides)
    except Exception as exc:  # noqa: BLE001 - its __post_init__'s checks of the whole, which raise many kinds
        first = (str(exc).splitlines() or [""])[0][:200]
        raise BadInput(
            f"megatron-core refused the settings ({exc.__class__.__name__}: {first})", field="train.megatron"
        ) from None


class ValueHead(torch.nn.Module):
    """PPO's critic's output layer in a GPTModel (slime's LinearForLastLayer): Linear(hidden, 1) with a bias, the
    same on every TP rank, its output in float32; called as GPTModel calls its output layer."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias).float(), None


def build(hf_config, dims: Dims, config, critic: bool = False) -> torch.nn.Module:
    """The GPTModel of this rank (parallel state must be initialised), every parameter of `params_dtype`:
    the local spec's norms (torch.nn.RMSNorm, made without a dtype) come in torch's default, float32, and
    are cast. RoPE's frequencies are no parameter: they stay float32, as transformers computes them.
    `critic`: PPO's critic, its output layer a `ValueHead` (untied, as slime's critic role unties it)."""
    with quiet():
        from megatron.core.models.gpt import GPTModel

        spec = _layer_spec(dims)
        gpt = GPTModel(
            config,
            spec,
            vocab_size=dims.vocab,
            max_sequence_length=hf_config.max_position_embeddings,
            parallel_output=False,
            share_embeddings_and_output_weights=dims.tied and not critic,
            position_embedding_type="rope",
            rotary_base=hf_config.rope_parameters["rope_theta"],
        )
    if critic:
        gpt.output_layer = ValueHead(dims.hidden, config.params_dtype)
    return gpt.to(dtype=config.params_dtype)


def _layer_spec(dims: Dims):
    if dims.te_names:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")


def token_values(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A critic GPTModel's value of token t (t >= 1) read at position t - 1, float32 [n, L], position 0 gets 0 (as
    core/critic.py's token_values)."""
    return torch.nn.functional.pad(logits(model, ids)[..., 0][:, :-1], (1, 0))


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[n, L, vocab] logits of right-padded ids (Megatron's RoPE uses positions 0..L-1, as HF does here)."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return model(ids, positions, None)
