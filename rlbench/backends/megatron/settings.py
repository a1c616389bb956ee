"""The `[train.megatron]` table, checked before any rank process starts (model.check calls it with
megatron-core's TransformerConfig fields), so that what would fail inside megatron-core, in a rank,
after the processes started, is one line of bad input instead:

- each key a TransformerConfig field that rlbench does not set itself (OWNED), each value of that
  field's type as megatron-core declares it. TOML gives booleans, integers, floats, strings and
  lists; a bool is never taken for an integer nor an integer for a bool (Python's bool is an int,
  so megatron-core would take either silently); an integer is a float's value (TOML's `1` for 1.0),
  passed as it is. A field whose type no TOML value has (a callable, a torch dtype, an enum, a
  class) is refused by name;
- the precision the chosen device can run: on the CPU the trainer trains in the model's dtype,
  float32, float64 or bfloat16 (`model.dtype`; the table's fp16, bf16, fp8 and fp4 are megatron-core's GPU
  paths); on a
  GPU, bf16 needs a device that has it, fp8 and fp4 need Transformer Engine and a device of their
  generation.

This module imports no megatron-core: the caller hands it the fields.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import math
import types
import typing

from rlbench.errors import BadInput

FIELD = "train.megatron"
# Set from the model's config.json or by rlbench's loop; not [train.megatron] settings.
OWNED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "normalization",
    "layernorm_epsilon",
    "gated_linear_unit",
    "activation_func",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "hidden_dropout",
    "attention_dropout",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "params_dtype",
    "use_cpu_initialization",
    "calculate_per_token_loss",
    "deterministic_mode",
)
# Precision flags: (key, the CUDA compute capability it needs, whether it needs Transformer Engine).
PRECISION = (("fp16", (0, 0), False), ("bf16", (8, 0), False), ("fp8", (8, 9), True), ("fp4", (10, 0), True))


def has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def check_table(table: dict, fields: dict[str, dataclasses.Field], hints: dict[str, object], device: str) -> None:
    """The `[train.megatron]` table against TransformerConfig's `fields` and their types (`hints`), then
    its precision against `device`."""
    taken = sorted(set(table) & set(OWNED))
    if taken:
        raise BadInput(f"{', '.join(taken)}: set from the model's config.json or by rlbench, not here", field=FIELD)
    for key, value in table.items():
        if key not in fields or not fields[key].init:
            raise BadInput(
                "not a field of megatron-core's TransformerConfig that a config sets", field=f"{FIELD}.{key}"
            )
        kind = hints[key]
        if not fits(value, kind):
            raise BadInput(f"expected {describe(kind)}, got {_shown(value)}", field=f"{FIELD}.{key}")
    check_precision(table, device)


def check_precision(table: dict, device: str) -> None:
    """fp16 / bf16 / fp8 / fp4 only where `device` runs them (see the module docstring)."""
    asked = [(key, need, te) for key, need, te in PRECISION if table.get(key) not in (None, False)]
    for key, need, te in asked:
        if not device.startswith("cuda"):
            raise BadInput(
                f"expected {'false' if key in ('fp16', 'bf16') else 'unset'} on the CPU, got "
                f"{_shown(table[key])}: the megatron trainer trains in model.dtype (float32, float64, or "
                f"bfloat16 over fp32 masters) there (megatron-core's {key} flag is its GPU path)",
                field=f"{FIELD}.{key}",
            )
        import torch

        have = torch.cuda.get_device_capability(torch.device(device if ":" in device else "cuda:0"))
        if tuple(have) < need:
            raise BadInput(
                f"{key} needs a GPU of compute capability {need[0]}.{need[1]} or later; "
                f"{torch.cuda.get_device_name(0)} is {have[0]}.{have[1]}",
                field=f"{FIELD}.{key}",
            )
        if te and not has_transformer_engine():
            raise BadInput(f"{key} needs Transformer Engine, which is not installed here", field=f"{FIELD}.{key}")


def fits(value: object, kind: object) -> bool:
    """Whether a TOML (or manifest JSON) value is of the declared type `kind`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is str:
        return isinstance(value, str)
    if kind is list or origin is list:
        return isinstance(value, list) and all(fits(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is tuple:  # TOML and JSON hold a tuple as a list
        if not isinstance(value, list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(fits(v, a) for v, a in zip(value, args))
    if kind is dict or origin is dict:
        return isinstance(value, dict)
    return False  # a callable, a dtype, an enum, a class: no TOML value is one


def describe(kind: object) -> str:
    """What `fits` takes for `kind`, in words."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join([p for p in parts if not p.endswith(_FOREIGN)] or parts)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    words = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string", dict: "a table"}
    if kind in words:
        return words[kind]
    if kind is list or origin is list:
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is tuple:
        if not args or args[-1] is Ellipsis:
            return f"a list of {_plural(args[0])}" if args else "a list"
        return f"a list of {len(args)} {_plural(args[0])}" if len(set(args)) == 1 else f"a list of {len(args)} values"
    name = getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
    what = "an enum" if isinstance(kind, type) and issubclass(kind, enum.Enum) else "a Python object"
    return f"{name} ({what}{_FOREIGN}"


_FOREIGN = ", which a TOML table cannot give)"


def _plural(kind: object) -> str:
    return {bool: "booleans", int: "integers", float: "numbers", str: "strings"}.get(kind, describe(kind))


def _shown(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."
