"""AdamW's parameter groups and state by parameter name, shared by the torch and megatron trainers: which
parameters decay, the state as tensors and JSON for a checkpoint, and its loading back, every entry held to the
model's parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from rlbench.errors import BadInput


def decays(name: str, shape: Sequence[int]) -> bool:
    """Whether a parameter takes weight decay, by Megatron's rule (megatron-core's `get_standard_config_overrides`,
    which slime's optimizer runs with): a bias (the name ends in ".bias") or a 1-D tensor (a norm's weight) does not.
    slime's `--apply-wd-to-qk-layernorm` (decay on q/k norms too) is not modelled: slime_args.py refuses it."""
    return not (name.endswith(".bias") or len(shape) == 1)


def decay_groups(named: Mapping[str, torch.Tensor], weight_decay: float) -> list[dict]:
    """AdamW's param groups for the parameters `named` (by name, in the model's order), as megatron-core orders
    them: those that decay (`weight_decay`), then those that do not (0.0). A group with no parameter is left out,
    as megatron-core makes none."""
    split: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for name, param in named.items():
        split[decays(name, param.shape)].append(param)
    groups = [{"params": split[True], "weight_decay": weight_decay}, {"params": split[False], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def check_weight_decays(meta: object, have: Sequence[float], path: Path, field: str = "param_groups") -> None:
    """Refuse (BadInput naming `path` and `field`) a saved optimizer whose param groups' weight decays (`meta`'s
    `param_groups`) are not `have`, this run's, in order: resuming it would change the run. A state of one group
    (rlbench before Megatron's rule: every parameter decayed alike) resumes where every group here has its weight
    decay: at weight decay 0, every default-config checkpoint resumes bit for bit."""
    groups = meta.get("param_groups") if isinstance(meta, dict) else None
    saved = (
        [group.get("weight_decay") if isinstance(group, dict) else None for group in groups]
        if isinstance(groups, list)
        else []
    )
    if not saved or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in saved):
        raise BadInput(
            'expected a list of {"weight_decay": number, ...}, one per AdamW param group', path=path, field=field
        )
    have = list(have)
    if saved == have or (len(saved) == 1 and all(w == saved[0] for w in have)):
        return
    raise BadInput(
        f"the saved optimizer's param groups have weight decays {saved}, this run's {have} (Megatron's "
        "rule: none on biases and 1-D parameters): resuming it would change the run",
        path=path,
        field=field,
    )


def optimizer_tensors(optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """AdamW's state tensors (`field/param name`), where they live."""
    names = {id(p): name for name, p in named.items()}
    return {
        f"{key}/{names[id(param)]}": value.detach()
        for param, state in optimizer.state.items()
        for key, value in state.items()
        if torch.is_tensor(value) and value.dim() > 0
    }


def optimizer_meta(optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor]) -> dict:
    """AdamW's state that is not a tensor, as JSON (param groups, scalars such as the step count by
    `field/param name`); `named`: the optimizer's parameters by name. Its tensors: `optimizer_tensors`."""
    names = {id(p): name for name, p in named.items()}
    scalars = {
        f"{key}/{names[id(param)]}": float(value)
        for param, state in optimizer.state.items()
        for key, value in state.items()
        if not (torch.is_tensor(value) and value.dim() > 0)
    }
    return {
        "optimizer": "AdamW",
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scalars": scalars,
    }


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    named: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    scalars: object,
    device: str,
    source: Path,
) -> None:
    """The inverse of `optimizer_tensors` and `optimizer_meta`, every entry held to the optimizer's parameters
    `named` (BadInput naming `source`)."""
    if not isinstance(scalars, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in scalars.values()
    ):
        raise BadInput('optimizer state: expected {"scalars": {name: number}}', path=source)
    params = named
    for key, value in {**tensors, **scalars}.items():
        field, _, name = key.partition("/")
        if (
            name not in params
            or field not in ("step", "exp_avg", "exp_avg_sq")
            or (torch.is_tensor(value) and value.shape != params[name].shape)
        ):
            raise BadInput(f"optimizer state {key!r} fits no parameter of the model", path=source)
        state = optimizer.state[params[name]]
        # a fused AdamW keeps its step count on the parameter's device (the for-loop one on the CPU)
        home = params[name].device if optimizer.defaults.get("fused") else "cpu"
        state[field] = value.to(device) if torch.is_tensor(value) else torch.tensor(float(value), device=home)
