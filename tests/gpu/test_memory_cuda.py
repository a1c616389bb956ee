"""The memory settings on a GPU (issue 34; the CPU side is tests/cpu/test_memory_settings.py): the engine's weights
leave the card after each rollout and its memory is freed; recompute and the rollout offload keep a deterministic
run's bits; the optimizer offload (the update on the CPU) repeats bit for bit, trains to within rounding of the GPU
update, and holds less memory on the card."""

from __future__ import annotations

import json

import torch

from rlbench.config import load_config
from rlbench.session import run
from tests.helpers import cuda_bf16
from tests.conftest import RANDOM_INIT_MODEL


def _bf16(out, **overrides):
    return cuda_bf16(out, steps=3, checkpoint_every=10, **overrides)


def _sums(out) -> list[dict]:
    return [json.loads(line) for line in (out / "checksums.jsonl").read_text().splitlines()]


def test_the_offloaded_engine_moves_its_weights_off_the_card_and_answers_the_same():
    from rlbench.backends.engine_memory import OffloadedEngine
    from rlbench.backends.hf_engine import HFEngine
    from rlbench.core.model import build_model
    from rlbench.core.types import GenerateRequest

    model = build_model(RANDOM_INIT_MODEL, master_seed=1, dtype="bfloat16", init="random")
    plain = HFEngine(model, device="cuda", batch_size=8)
    requests = [GenerateRequest((5, 6, 7 + i), 40 + i, 6, 1.0, (2,)) for i in range(5)]
    want = plain.generate(requests)
    del plain
    torch.cuda.synchronize()
    engine = OffloadedEngine(HFEngine(model, device="cuda", batch_size=8))
    assert engine.generate(requests) == want  # captured graphs, then let go
    assert engine.away and not engine.graphs
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    released = torch.cuda.memory_allocated()  # (cuBLAS's workspaces, made by the first rollout, stay)
    engine.back()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert torch.cuda.memory_allocated() >= released + weights
    assert engine.generate(requests) == want and engine.away  # back, captured again, the same bits
    assert torch.cuda.memory_allocated() <= released  # its graphs, caches and weights let go of again


def test_recompute_and_rollout_offload_keep_a_deterministic_runs_bits(tmp_path):
    run(_bf16(tmp_path / "plain"))
    run(_bf16(tmp_path / "saving", train__recompute=True, rollout__offload=True))
    assert _sums(tmp_path / "plain") == _sums(tmp_path / "saving")


def test_the_optimizer_offload_repeats_and_trains_as_the_gpu_update_does(tmp_path):
    """The update on the CPU: two runs bit for bit, step 0's rollout and log-probs the GPU run's bits (the same
    weights); one update from the same state gives the GPU update's gradients bit for bit (added on the host with
    the device's arithmetic) and masters equal to rounding (the CPU's fused AdamW against CUDA's), with 16 bytes a
    parameter (master, its gradient, two moments) off the card."""
    run(_bf16(tmp_path / "a", train__optimizer_cpu_offload=True))
    run(_bf16(tmp_path / "b", train__optimizer_cpu_offload=True))
    run(_bf16(tmp_path / "plain"))
    assert (tmp_path / "a" / "checksums.jsonl").read_bytes() == (tmp_path / "b" / "checksums.jsonl").read_bytes()
    first, gpu = _sums(tmp_path / "a")[0], _sums(tmp_path / "plain")[0]
    for stage in ("rollout_tokens", "rollout_logprobs", "old_logprobs"):
        assert first[stage] == gpu[stage], stage

    import dataclasses

    from rlbench.backends.torch_trainer import TorchTrainer
    from rlbench.core.model import build_model
    from tests.helpers import train_batch, with_old_logprobs

    config = load_config()
    stats, masters, held = [], [], []
    for offload in (False, True):
        model = build_model(RANDOM_INIT_MODEL, master_seed=1, dtype="bfloat16", init="random")
        train = dataclasses.replace(config.train, minibatches=1, micro_batch_size=8, optimizer_cpu_offload=offload)
        trainer = TorchTrainer(model, train, config.algo, 1.0, seed=0, device="cuda")
        stats.append(trainer.train_step(with_old_logprobs(trainer, train_batch(0)), 0))
        torch.cuda.synchronize()
        held.append(torch.cuda.memory_allocated())
        masters.append({name: p.detach().cpu() for name, p in trainer.masters.params.items()})
        params = sum(p.numel() for p in trainer.model.parameters())
        del trainer, model
    assert stats[0].grads_digest == stats[1].grads_digest and stats[0].param_grads == stats[1].param_grads
    for name, master in masters[0].items():
        assert torch.allclose(masters[1][name], master, rtol=1e-5, atol=1e-8), name
    assert held[1] <= held[0] - 16 * params
