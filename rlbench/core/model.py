"""Loading the tokenizer and building the policy model, offline, with seeded initial weights.

No code from a directory it reads, ever: a tokenizer or model directory whose JSON names custom code (an
`auto_map` entry, or a tokenizer or processor class transformers does not have) is refused by name before
transformers is asked (`refuse_custom_code`), so its "run the custom code? [y/N]" prompt never comes, whatever
standard input holds; transformers is asked with trust_remote_code=False besides.

A model directory holds a transformers `config.json` and its weights as transformers saves them
(`model.safetensors`, or shards named by `model.safetensors.index.json`); pickled weights
(`pytorch_model.bin`) are refused. Whether a run starts from those weights or from random ones is
the config's `model.init`, never a guess from the directory. With random weights, every parameter
is drawn from its own seed, `derive_seed(master, "init", name)`: transformers' `_init_weights`
draws from the global RNG in module order, so its result would change with the module order and
with whatever ran before; ours depends on the name alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from rlbench.core.seeding import generator
from rlbench.errors import BadInput

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: everything is local
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# float64: the CPU's precision for invariance checks (TP/DP against one rank), where float32's reduction-order
# noise (~1e-6 relative) would hide a real bug of that size (config.py refuses it elsewhere).
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# The files of a tokenizer or model directory transformers reads for which classes to build, and the fields in them
# that name a class it looks up by name (a name it does not have is custom code, or nothing it can build).
CODE_FILES = ("tokenizer_config.json", "config.json", "processor_config.json", "preprocessor_config.json")
CLASS_FIELDS = ("tokenizer_class", "processor_class")
NO_CODE = "rlbench never runs code from a directory it reads"


def refuse_custom_code(path: Path) -> None:
    """BadInput naming the file and the field where `path`'s JSON asks for code of its own: an `auto_map`, or a
    tokenizer/processor class that is not transformers' (a file that does not parse is left to transformers)."""
    for file in (path / name for name in CODE_FILES):
        table = _json_object(file)
        if "auto_map" in table:
            raise BadInput(f"names custom code to import; {NO_CODE}", path=file, field="auto_map")
        for key in CLASS_FIELDS:
            name = table.get(key)
            if name is not None and not (isinstance(name, str) and {name, name.removesuffix("Fast")} & _transformers()):
                raise BadInput(f"{name!r} is not a transformers class; {NO_CODE}", path=file, field=key)


@functools.cache
def _transformers() -> frozenset[str]:
    """The names transformers exports (a saved tokenizer's `XTokenizerFast` is its `XTokenizer` since v5)."""
    import transformers

    return frozenset(dir(transformers))


def _json_object(file: Path) -> dict:
    """The JSON object in `file`, or {} where there is none (absent, unreadable, not an object)."""
    try:
        table = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}
    return table if isinstance(table, dict) else {}


def load_tokenizer(path: str | Path):
    """A fast tokenizer from a local directory (tokenizer.json + tokenizer_config.json), transformers' own class."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise BadInput("not a tokenizer directory (no tokenizer.json)", path=path)
    refuse_custom_code(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except RecursionError:
        raise BadInput("cannot load tokenizer: its JSON is nested too deeply", path=path) from None
    except Exception as exc:  # noqa: BLE001 - the tokenizers library rejects a malformed file in many ways
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise BadInput(f"cannot load tokenizer ({exc.__class__.__name__}: {first[:160]})", path=path) from None


# The sizes a model's config.json gives, each a count: held to [1, 2**31 - 1] before transformers reads them (it
# warns about some and fails on others deep inside the model's construction).
SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
)


def _check_sizes(path: Path) -> None:
    """The sizes config.json sets, where it parses as an object (transformers says why it does not)."""
    table = _json_object(path)
    for key in SIZES:
        value = table.get(key)
        if (
            key in table
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31)
        ):
            raise BadInput(f"expected an integer in [1, 2**31 - 1], got {value!r}", path=path, field=key)


def load_model_config(path: str | Path):
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise BadInput("not a model directory (no config.json)", path=path)
    _check_sizes(path / "config.json")
    refuse_custom_code(path)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except RecursionError:
        raise BadInput("cannot load model config: nested too deeply", path=path / "config.json") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise BadInput(
            f"cannot load model config ({exc.__class__.__name__}: {str(exc).splitlines()[0]})",
            path=path / "config.json",
        ) from None


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


INITS = ("checkpoint", "random")
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Weight files rlbench does not read: pickles (torch.load runs code from the file) and other frameworks'.
_UNREAD = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5", "flax_model.msgpack")


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files a model directory's weights are in, as transformers picks them: the
    single `model.safetensors` if there is one, else the shards its index names (each checked to
    exist); [] when it has neither. A directory with only pickled weights is bad input."""
    path = Path(path)
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    if (path / INDEX).is_file():
        return [path / name for name in sorted(set(_index(path / INDEX).values()))]
    unread = [name for name in _UNREAD if (path / name).is_file()]
    if unread or any(path.glob("pytorch_model-*.bin")):
        raise BadInput(
            f"holds {(unread or ['pytorch_model-*.bin'])[0]}, a pickle or another framework's weights, and "
            "no model.safetensors: rlbench loads no pickle; save the model as safetensors first "
            "(transformers' save_pretrained writes them)",
            path=path,
        )
    return []


def _index(index: Path) -> dict[str, str]:
    """A sharded checkpoint's index: its weight_map (tensor name -> shard file), each shard present."""
    try:
        table = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadInput(f"cannot read the index ({exc.__class__.__name__})", path=index) from None
    weight_map = table.get("weight_map") if isinstance(table, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise BadInput("expected a non-empty object of tensor name -> shard file", path=index, field="weight_map")
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if Path(name).name != name or not shard.is_file():
            raise BadInput(f"shard {name!r} named by the index is missing", path=index, field="weight_map")
    return weight_map


def initial_weights(path: str | Path, init: str, seed: int) -> dict:
    """Which weights a model built by `build_model(path, seed, init=init)` starts from, for the
    manifest and the summary: the checkpoint's files with their sha256, or the random seed. Holds
    `init` to what the directory has: a checkpoint needs weights, random weights need a directory
    without any (nothing in it is ignored unsaid)."""
    files = weight_files(path)
    if init == "checkpoint":
        if not files:
            raise BadInput(
                f'no weights here (neither {SINGLE} nor {INDEX}); model.init = "random" starts from random weights',
                path=path,
            )
        return {"init": "checkpoint", "path": str(Path(path)), "files": {f.name: file_digest(f) for f in files}}
    if init == "random":
        if files:
            raise BadInput(
                f"model.init is random, but the directory holds weights ({files[0].name}); "
                'model.init = "checkpoint" loads them',
                path=path,
            )
        return {"init": "random", "seed": seed}
    raise BadInput(f"expected one of {', '.join(INITS)}, got {init!r}", field="model.init")


def build_model(path: str | Path, master_seed: int, dtype: str = "float32", device: str = "cpu", *, init: str):
    """The policy: a transformers causal LM from `path`'s config.json, with the checkpoint's weights
    (`init="checkpoint"`: the single file or every shard of the index; bf16/fp16 weights are cast
    to `dtype`) or seeded random weights (`init="random"`, a directory without weights)."""
    from transformers import AutoModelForCausalLM

    config = load_model_config(path)
    files = weight_files(path)
    initial_weights(path, init, master_seed)  # init agrees with what the directory holds
    # Construction runs transformers' own init on the global RNG; fork it so nothing leaks out.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    if init == "checkpoint":
        load_checkpoint_(model, files)
    else:
        init_weights_(model, master_seed, getattr(config, "initializer_range", 0.02))
    return model.to(device=device, dtype=_DTYPES[dtype])


def load_checkpoint_(model: torch.nn.Module, files: list[Path]) -> None:
    """Copy a checkpoint's files into `model`: every parameter from exactly one file, each shard
    holding exactly the names its index gives it; a tied alias (lm_head.weight of a model that ties
    it to the embeddings) is accepted only equal to the tensor it is tied to."""
    index = _index(files[0].parent / INDEX) if files[0].name != SINGLE else None
    params = dict(model.named_parameters())
    aliases = {name: t for name, t in model.state_dict(keep_vars=True).items() if name not in params}
    merged: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for file in files:
        tensors = load_safetensors(file)
        if index is not None:
            listed = {name for name, shard in index.items() if shard == file.name}
            if set(tensors) != listed:
                extra, absent = sorted(set(tensors) - listed), sorted(listed - set(tensors))
                raise BadInput(
                    f"the shard does not hold what the index says (not listed: {extra[:3]}, missing: {absent[:3]})",
                    path=file,
                )
        for name, tensor in tensors.items():
            if name in params and (tuple(tensor.shape) != tuple(params[name].shape) or not tensor.is_floating_point()):
                raise BadInput(
                    f"'{name}' is {tensor.dtype} of shape {tuple(tensor.shape)}, the model expects a float "
                    f"tensor of shape {tuple(params[name].shape)}",
                    path=file,
                )
            origin[name] = file
            merged[name] = tensor
    tied = {name: merged.pop(name) for name in list(merged) if name in aliases}  # checked once loaded
    load_named_(model, merged, source=files[0].parent)
    for name, tensor in tied.items():
        here = aliases[name].detach()
        if tuple(tensor.shape) != tuple(here.shape) or not torch.equal(tensor.to(here.dtype), here):
            raise BadInput(
                f"'{name}' is tied to another weight in this model's config but differs from it in the checkpoint",
                path=origin[name],
            )


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a truncated or corrupt file is bad input naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:  # sorted by name: `load` hands them out in a per-process hash order, and order reaches state dicts
        return dict(sorted(load(Path(path).read_bytes()).items()))
    except (SafetensorError, OSError, ValueError) as exc:
        raise BadInput(
            f"corrupt or unreadable safetensors ({exc.__class__.__name__}: {str(exc)[:100]})", path=path
        ) from None


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters under their Hugging Face names; tied weights appear once (as named_parameters gives)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def load_named_(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: object = "weights") -> None:
    """Copy Hugging Face-named tensors into `model`; the name sets and shapes must match exactly."""
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or unexpected:
        raise BadInput(
            f"weight names do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})",
            path=str(source),
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(params[name].shape) or not tensor.is_floating_point():
                raise BadInput(
                    f"'{name}' is {tensor.dtype} of shape {tuple(tensor.shape)}, the model expects a float "
                    f"tensor of shape {tuple(params[name].shape)}",
                    path=str(source),
                )
            params[name].copy_(tensor)


def file_digest(*paths: Path) -> str:
    """sha256 over the names and bytes of files (a directory means its files, sorted)."""
    digest = hashlib.sha256()
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()
