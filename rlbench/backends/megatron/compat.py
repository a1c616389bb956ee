"""The CPU compatibility layer: megatron-core 0.16.1 on a machine without CUDA.

megatron-core assumes a GPU in a handful of places that a CPU run (gloo, local layer spec,
`use_cpu_initialization=True`) still reaches. Each `Redirect` below replaces one such call with
its CPU meaning, and says which megatron-core code needs it. Nothing else is changed: there is
no CUDA in the process, so every replaced function would only have raised (or, for the lazy
seeding calls, silently done nothing).

`apply()` is called once per process by the trainer, and only when it trains on the CPU; on a
GPU none of this is touched. tests/cpu/test_megatron_compat.py has one test per redirect that
shows the megatron-core call still fails (or misbehaves) without it and works with it, so an
upgrade that makes a redirect unnecessary, or breaks it, shows at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Redirect:
    name: str
    module: str  # where the attribute lives
    attr: str
    replacement: Callable
    needed_by: str


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _cpu_rng_state(device: object = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """megatron.core.transformer.utils.get_default_causal_mask, built on the CPU (True = masked)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


REDIRECTS = (
    Redirect(
        "current_device",
        "torch.cuda",
        "current_device",
        _cpu_device,
        "RotaryEmbedding.get_emb moves inv_freq to it; DistributedDataParallel allocates its grad buffers on it",
    ),
    Redirect(
        "cuda_get_rng_state",
        "torch.cuda",
        "get_rng_state",
        _cpu_rng_state,
        "CudaRNGStatesTracker.add, called by model_parallel_cuda_manual_seed",
    ),
    Redirect(
        "cuda_manual_seed",
        "torch.cuda",
        "manual_seed",
        _cpu_manual_seed,
        "model_parallel_cuda_manual_seed: on a CPU build the CUDA call is queued and never runs, "
        "so every tracked RNG state would be the same, whatever the seed",
    ),
    Redirect(
        "tracker_get_state",
        "megatron.core.tensor_parallel.random",
        "_get_cuda_rng_state",
        _cpu_rng_state,
        "CudaRNGStatesTracker.fork, entered by DotProductAttention.forward on every call",
    ),
    Redirect(
        "tracker_set_state",
        "megatron.core.tensor_parallel.random",
        "_set_cuda_rng_state",
        _set_cpu_rng_state,
        "CudaRNGStatesTracker.fork: without it the forked state is never set nor restored",
    ),
    Redirect(
        "causal_mask",
        "megatron.core.transformer.utils",
        "get_default_causal_mask",
        _cpu_causal_mask,
        "the default causal mask is built with device='cuda'",
    ),
    Redirect(
        "softmax_causal_mask",
        "megatron.core.fusions.fused_softmax",
        "get_default_causal_mask",
        _cpu_causal_mask,
        "FusedScaleMaskSoftmax imports get_default_causal_mask by name",
    ),
)

_originals: dict[tuple[str, str], object] = {}


def apply(redirects: tuple[Redirect, ...] = REDIRECTS) -> None:
    """Install the redirects (idempotent). Only for a process that trains on the CPU."""
    for r in redirects:
        owner = importlib.import_module(r.module)
        _originals.setdefault((r.module, r.attr), getattr(owner, r.attr))
        setattr(owner, r.attr, r.replacement)


def remove(redirects: tuple[Redirect, ...] = REDIRECTS) -> None:
    """Put the original functions back (the compatibility tests run each call with and without)."""
    for r in redirects:
        if (r.module, r.attr) in _originals:
            setattr(importlib.import_module(r.module), r.attr, _originals.pop((r.module, r.attr)))
