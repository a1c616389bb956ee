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

import torch

_DOMAIN = b"rlbench.seed/1\x00"


def derive_seed(master: int, purpose: str, *path: int | str) -> int:
    """A 63-bit seed for one purpose ("init", "sample", "data", ...) at one place (step, index)."""
    key = json.dumps([int(master), purpose, *path], separators=(",", ":")).encode()
    return int.from_bytes(hashlib.sha256(_DOMAIN + key).digest()[:8], "little") >> 1


def generator(master: int, purpose: str, *path: int | str, device: str = "cpu") -> torch.Generator:
    """A torch.Generator seeded from `derive_seed`; the caller owns it, no global state is touched."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(master, purpose, *path))
    return gen


def configure_determinism(threads: int, device: str) -> dict:
    """Fix the thread count and turn on deterministic algorithms; return what was set, for the manifest."""
    if device.startswith("cuda"):
        # cuBLAS needs this before its first handle is made, else deterministic mode raises.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    return {
        "torch_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "seed_derivation": "sha256(rlbench.seed/1 || json([master, purpose, *path]))[:8] >> 1",
    }
