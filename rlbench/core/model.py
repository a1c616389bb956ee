"""Loading the tokenizer and building the policy model, offline, with seeded initial weights.

A model directory holds a transformers `config.json` and, optionally, `model.safetensors`.
Without weights, every parameter is drawn from its own seed, `derive_seed(master, "init", name)`:
transformers' `_init_weights` draws from the global RNG in module order, so its result would
change with the module order and with whatever ran before; ours depends on the name alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from rlbench.core.seeding import generator
from rlbench.errors import BadInput

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: everything is local
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_tokenizer(path: str | Path):
    """A fast tokenizer from a local directory (tokenizer.json + tokenizer_config.json)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise BadInput("not a tokenizer directory (no tokenizer.json)", path=path)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except RecursionError:
        raise BadInput("cannot load tokenizer: its JSON is nested too deeply", path=path) from None
    except Exception as exc:  # noqa: BLE001 - the tokenizers library rejects a malformed file in many ways
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise BadInput(f"cannot load tokenizer ({exc.__class__.__name__}: {first[:160]})", path=path) from None


def load_model_config(path: str | Path):
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise BadInput("not a model directory (no config.json)", path=path)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except RecursionError:
        raise BadInput("cannot load model config: nested too deeply", path=path / "config.json") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BadInput(f"cannot load model config ({exc.__class__.__name__}: {str(exc).splitlines()[0]})",
                       path=path / "config.json") from None


def init_weights_(model: torch.nn.Module, master_seed: int, std: float) -> None:
    """Draw every parameter from a seed derived from its name (norm weights 1, biases 0)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # RMSNorm / LayerNorm scales
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator(master_seed, "init", name), dtype=torch.float32)
                param.copy_(values * std)


def build_model(path: str | Path, master_seed: int, dtype: str = "float32", device: str = "cpu"):
    """The policy: a transformers causal LM from `path`, with its weights file or seeded weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = load_model_config(path)
    # Construction runs transformers' own init on the global RNG; fork it so nothing leaks out.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = Path(path) / "model.safetensors"
    if weights.is_file():
        load_named_(model, load_safetensors(weights), source=weights)
    else:
        init_weights_(model, master_seed, getattr(config, "initializer_range", 0.02))
    return model.to(device=device, dtype=_DTYPES[dtype])


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a truncated or corrupt file is bad input naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:  # sorted by name: `load` hands them out in a per-process hash order, and order reaches state dicts
        return dict(sorted(load(Path(path).read_bytes()).items()))
    except (SafetensorError, OSError, ValueError) as exc:
        raise BadInput(f"corrupt or unreadable safetensors ({exc.__class__.__name__}: {str(exc)[:100]})",
                       path=path) from None


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters under their Hugging Face names; tied weights appear once (as named_parameters gives)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def load_named_(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: object = "weights") -> None:
    """Copy Hugging Face-named tensors into `model`; the name sets and shapes must match exactly."""
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise BadInput(f"weight names do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})",
                       path=str(source))
    with torch.no_grad():
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(params[name].shape) or not tensor.is_floating_point():
                raise BadInput(f"'{name}' is {tensor.dtype} of shape {tuple(tensor.shape)}, the model expects a float "
                               f"tensor of shape {tuple(params[name].shape)}", path=str(source))
            params[name].copy_(tensor)


def file_digest(*paths: Path) -> str:
    """sha256 over the names and bytes of files (a directory means its files, sorted)."""
    digest = hashlib.sha256()
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()
