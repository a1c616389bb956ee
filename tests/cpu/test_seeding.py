"""Seeds (rlbench/core/seeding.py): derive_seed is a pure, pinned function of its key, the same in every
process; generators draw from it; the deterministic settings are set and reported as configured."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbench.core.seeding import GPU_RECIPE, configure_determinism, derive_seed, generator

PROPERTY = settings(max_examples=50, deadline=None, database=None)  # hermetic: no .hypothesis/


def test_derive_seed_is_deterministic_and_in_range():
    seeds = [
        derive_seed(master, purpose, step, index)
        for master in (0, 1, 2**63 - 1)
        for purpose in ("init", "sample", "data")
        for step in range(4)
        for index in range(4)
    ]
    assert seeds == [
        derive_seed(master, purpose, step, index)
        for master in (0, 1, 2**63 - 1)
        for purpose in ("init", "sample", "data")
        for step in range(4)
        for index in range(4)
    ]
    assert all(0 <= s < 2**63 for s in seeds)
    assert len(set(seeds)) == len(seeds)  # differs by master, purpose, step and index


def test_derive_seed_pinned_value():
    """The derivation is part of the run format: a change here breaks every recorded seed."""
    assert derive_seed(1234, "sample", 0, 0) == 389002002616586331
    assert derive_seed(0, "data", 0) == 2965597561215025095
    assert derive_seed(1234, "sample", 0, 1) != derive_seed(1234, "sample", 1, 0)
    assert derive_seed(1234, "sample", 1) != derive_seed(1234, "sample", "1")


def test_derive_seed_is_the_same_in_a_process_with_another_hash_seed():
    """Python's str and bytes hashes are salted per process (PYTHONHASHSEED): a process with another salt
    derives the same seeds as this one. (Two calls in one process would agree even through hash().)"""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    keys = [(1234, "sample", 3, 1), (7, "init", "model.embed_tokens.weight"), (0, "data", 2)]
    code = (
        f"from rlbench.core.seeding import derive_seed; print(hash('rlbench'), [derive_seed(*key) for key in {keys!r}])"
    )
    salt = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": salt, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    their_hash, their_seeds = proc.stdout.split(" ", 1)
    assert int(their_hash) != hash("rlbench"), "the other process must have another salt"
    assert their_seeds == f"{[derive_seed(*key) for key in keys]}\n"


@PROPERTY
@given(st.integers(0, 2**63 - 1), st.text(max_size=8), st.lists(st.integers(0, 2**40), max_size=3))
def test_derive_seed_range_property(master, purpose, path):
    seed = derive_seed(master, purpose, *path)
    assert 0 <= seed < 2**63
    assert seed == derive_seed(master, purpose, *path)


# ---------------------------------------------------------------- generator


def test_generator_is_seeded_by_derive_seed_and_owned_by_the_caller():
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    gen = generator(5, "sample", 2, 3)
    expected = torch.Generator().manual_seed(derive_seed(5, "sample", 2, 3))
    assert torch.equal(torch.rand(8, generator=gen), torch.rand(8, generator=expected))
    assert gen.initial_seed() == derive_seed(5, "sample", 2, 3) and gen.device == torch.device("cpu")
    assert torch.equal(torch.random.get_rng_state(), before)  # the global generator is untouched
    assert not torch.equal(
        torch.rand(8, generator=generator(5, "sample", 2, 4)), torch.rand(8, generator=generator(5, "sample", 2, 3))
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks that a CUDA generator is asked for, where there is none")
def test_generator_is_made_on_the_device_asked_for():
    with pytest.raises(RuntimeError):
        generator(5, "sample", device="cuda")  # not quietly a CPU generator


# ---------------------------------------------------------------- configure_determinism


@pytest.fixture
def restored():
    """configure_determinism sets process-wide state: start with no GPU recipe variables, and put everything back
    (by hand: monkeypatch.delenv of an unset variable would not remove what the code sets, and later runs in
    this worker would record the GPU recipe's cuBLAS setting in their manifests)."""
    env = {key: os.environ.pop(key, None) for key in GPU_RECIPE}
    saved = (
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    yield
    for key, value in env.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    torch.set_num_threads(saved[0])
    torch.use_deterministic_algorithms(saved[1])
    (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    ) = saved[2:]


SEED_DERIVATION = "sha256(rlbench.seed/1 || json([master, purpose, *path]))[:8] >> 1"


def test_the_cpu_is_always_deterministic(restored):
    torch.use_deterministic_algorithms(False)
    settings = configure_determinism(2, "cpu")
    assert settings == {
        "torch_threads": 2,
        "deterministic_algorithms": True,
        "cublas_workspace_config": None,
        "seed_derivation": SEED_DERIVATION,
    }
    assert torch.get_num_threads() == 2 and torch.are_deterministic_algorithms_enabled()
    assert not any(key in os.environ for key in GPU_RECIPE)  # the GPU recipe is not for the CPU
    assert configure_determinism(1, "cpu", deterministic=True)["torch_threads"] == 1


def test_a_gpu_in_deterministic_mode_gets_slimes_recipe(restored, monkeypatch):
    """Settable without a GPU: the recipe is environment variables and backend flags."""
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # a user's own setting is kept
    settings = configure_determinism(1, "cuda:1", deterministic=True)
    assert settings == {
        "torch_threads": 1,
        "deterministic_algorithms": True,
        "cublas_workspace_config": ":4096:8",
        "seed_derivation": SEED_DERIVATION,
        "deterministic": True,
        "cudnn_deterministic": True,
        "allow_tf32": False,
        "nccl_algo": "Tree",
        "nvte_allow_nondeterministic_algo": "0",
    }
    assert (os.environ["CUBLAS_WORKSPACE_CONFIG"], os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"]) == (":4096:8", "0")
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_a_gpu_by_default_keeps_the_library_defaults(restored):
    torch.backends.cuda.matmul.allow_tf32 = True
    settings = configure_determinism(1, "cuda")
    assert settings == {
        "torch_threads": 1,
        "deterministic_algorithms": False,
        "cublas_workspace_config": None,
        "seed_derivation": SEED_DERIVATION,
        "deterministic": False,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "allow_tf32": True,
        "nccl_algo": None,
        "nvte_allow_nondeterministic_algo": None,
    }
    assert not any(key in os.environ for key in GPU_RECIPE)
