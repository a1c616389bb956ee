"""Seeds derived from (master seed, purpose, indices), and the deterministic torch settings.

Every random draw in rlbench takes a seed from `derive_seed`, never from global RNG state,
so a sample's randomness does not depend on batch composition, engine count or resume
point. The seed is a hash of a canonical byte string (JSON of the key), not Python's
`hash()`, which is salted per process.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DOMAIN = b"rlbench.seed/1\x00"
# slime's GPU reproducibility environment; NVTE_* is read by Transformer Engine where it is installed.
GPU_RECIPE = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


def derive_seed(master: int, purpose: str, *path: int | str) -> int:
    """A 63-bit seed for one purpose ("init", "sample", "data", ...) at one place (step, index)."""
    key = json.dumps([int(master), purpose, *path], separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(_DOMAIN + key).digest()[:8], "little") >> 1


def generator(master: int, purpose: str, *path: int | str, device: str = "cpu") -> torch.Generator:
    """A torch.Generator seeded from `derive_seed`; the caller owns it, no global state is touched."""
    import torch  # here, not at the top: derive_seed alone needs no torch (a cross-process test imports it)

    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(master, purpose, *path))
    return gen


def configure_determinism(threads: int, device: str, deterministic: bool = False) -> dict:
    """Fix the thread count and turn on deterministic algorithms; return what was set, for the manifest.

    On the CPU this is always on. On a GPU only with `deterministic`: slime's reproducibility
    recipe (docs/en/advanced/reproducibility.md): deterministic algorithms and cuDNN, the cuBLAS
    workspace config, NCCL's Ring algorithm, Transformer Engine's deterministic kernels only, no
    TF32; megatron-core's own `deterministic_mode` follows it (backends/megatron/model.py). The
    environment is set before any CUDA or NCCL handle exists, and rank processes inherit it."""
    import torch

    cuda = device.startswith("cuda")
    if cuda and deterministic:
        for key, value in GPU_RECIPE.items():
            os.environ.setdefault(key, value)  # cuBLAS reads its config when its first handle is made
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(not cuda or deterministic)
    settings = {
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "seed_derivation": "sha256(rlbench.seed/1 || json([master, purpose, *path]))[:8] >> 1",
    }
    if cuda:
        settings.update(
            {
                "deterministic": deterministic,
                "cudnn_deterministic": torch.backends.cudnn.deterministic,
                "allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                **{key.lower(): os.environ.get(key) for key in GPU_RECIPE if key != "CUBLAS_WORKSPACE_CONFIG"},
            }
        )
    return settings
