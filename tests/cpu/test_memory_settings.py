"""The memory settings (issue 34), each one of slime's or Megatron's: `train.recompute` (layers recomputed in the
backward), `train.optimizer_cpu_offload` (fp32 masters, their gradients and AdamW's state in host memory) and
`rollout.offload` (the embedded engine lets go of its GPU memory between rollouts). On the CPU each computes the
same bits as the run without it: the gradients, the losses, the weights and the optimizer state, step by step, in
float32 and in bf16 over fp32 masters. The GPU side (weights moved off the card, the memory saved) is
tests/gpu/test_memory_cuda.py."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from rlbench.backends.torch_trainer import TorchTrainer
from rlbench.config import load_config
from rlbench.core.model import build_model
from rlbench.errors import BadInput
from tests.conftest import REPO, cli, small_toml
from tests.helpers import train_batch, with_old_logprobs, write_files
from tests.conftest import RANDOM_INIT_MODEL


def _trainer(dtype: str, **train) -> TorchTrainer:
    # no KL term (the default's kl_coef is 0.1 since issue 52): these batches carry no reference log-probs (the
    # loop computes them), and what is tested here does not depend on the KL term
    config = load_config(algo__kl_coef=0.0)
    model = build_model(RANDOM_INIT_MODEL, master_seed=1, dtype=dtype, init="random")
    settings = {"lr": 1e-3, "micro_batch_size": 5, "minibatches": 2, **train}  # 16 samples: micro-batches 5, 3
    return TorchTrainer(model, dataclasses.replace(config.train, **settings), config.algo, 1.0, seed=0)


def _state(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    """The model's weights and AdamW's moments by name (the optimizer's parameters in name order)."""
    out = {f"model/{n}": p.detach() for n, p in trainer.model.named_parameters()}
    named = trainer.masters.params if trainer.masters else dict(trainer.model.named_parameters())
    for name, p in named.items():
        out[f"master/{name}"] = p.detach()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = trainer.optimizer.state[p][key]
    return out


def _recomputes(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@pytest.mark.parametrize("dtype, clip", [("float32", 1.0), ("bfloat16", 1.0), ("bfloat16", 1e-4), ("bfloat16", 1e6)])
def test_recompute_and_optimizer_offload_compute_the_same_bits(dtype, clip):
    """Two rollout steps of two optimizer steps each, micro-batches of 5 and 3 samples: every loss, gradient
    checksum (the whole and per parameter), weight, master and moment equal bit for bit with and without the
    settings, whether the gradients are clipped (1e-4) or not (1e6); with offload the masters and AdamW's state are
    host tensors, a float32 model gets masters too."""
    plain = _trainer(dtype, grad_clip=clip)
    saving = _trainer(dtype, grad_clip=clip, recompute=True, optimizer_cpu_offload=True)
    assert _recomputes(saving.model) and not _recomputes(plain.model)
    assert saving.masters is not None and saving.masters.host and saving.optimizer_device == "cpu"
    assert (plain.masters is None) == (dtype == "float32")
    for step in range(2):
        stats = [t.train_step(with_old_logprobs(t, train_batch(step)), step) for t in (plain, saving)]
        assert torch.equal(stats[0].losses, stats[1].losses)
        assert stats[0].grads_digest == stats[1].grads_digest and stats[0].param_grads == stats[1].param_grads
        assert stats[0].metrics == stats[1].metrics
    a, b = _state(plain), _state(saving)
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert all(t.device.type == "cpu" for t in b.values())


def test_host_masters_add_each_gradient_as_the_device_path_does():
    """The staging hook: each backward's bf16 gradient is copied to a host buffer and added into the fp32 master
    gradient at the flush, exactly as the device hook adds it; a second backward before a flush adds the first
    gradient then (nothing overwritten)."""
    from rlbench.backends.master_weights import MasterWeights

    layer = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    masters = MasterWeights(layer, host=True)
    for scale in (1.0, 2.0**-10):  # exact in bf16; their sum 1 + 2**-10 only in fp32
        (layer(torch.ones(1, 1, dtype=torch.bfloat16)) * scale).sum().backward()
    assert masters.pending == ["weight"] and layer.weight.grad is None
    masters.flush()
    assert masters.pending == [] and masters.params["weight"].grad.item() == 1.0 + 2.0**-10


def test_the_host_gradients_norm_is_torchs_on_any_number_of_threads():
    """The offloaded clip's norm, each tensor's taken on a thread of its own: torch's get_total_norm, bit for bit, at
    each thread count."""
    from rlbench.backends.master_weights import total_norm

    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(n, generator=gen) * scale for n, scale in ((3, 1e-3), (70_001, 1.0), (5_000, 30.0))]
    before = torch.get_num_threads()
    try:
        pairs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            pairs.append((total_norm(grads), torch.nn.utils.get_total_norm(grads)))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(ours, torchs) and ours.dtype == torch.float32 for ours, torchs in pairs)


def test_host_gradients_start_again_each_minibatch_and_a_parameter_without_one_has_none():
    """The host gradients' buffers are kept between minibatches: after `zero` the first gradient overwrites its
    buffer (nothing of the last minibatch stays) and a parameter the backward did not reach has no gradient."""
    from rlbench.backends.master_weights import MasterWeights

    used, unused = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    masters = MasterWeights(torch.nn.ModuleDict({"used": used, "unused": unused}).to(torch.bfloat16), host=True)
    for scale, both in ((4.0, True), (2.0, False)):
        masters.zero()
        x = torch.ones(1, 1, dtype=torch.bfloat16)
        ((used(x) + (unused(x) if both else 0)) * scale).sum().backward()
        masters.settle()
    assert masters.params["used.weight"].grad.item() == 2.0 and masters.params["unused.weight"].grad is None


def test_an_offloaded_checkpoint_resumes_exactly_and_needs_its_masters(tmp_path):
    """A checkpoint of the offloaded trainer (masters and AdamW's state from host memory) restores them exactly:
    the next step equals the trainer that went on. A float32 checkpoint written without offload holds no masters:
    an offloaded trainer refuses it by name."""
    straight = _trainer("bfloat16", optimizer_cpu_offload=True)
    straight.train_step(with_old_logprobs(straight, train_batch(0)), 0)
    write_files(straight.save_checkpoint(), tmp_path / "ckpt")
    restored = _trainer("bfloat16", optimizer_cpu_offload=True)
    restored.load_checkpoint(tmp_path / "ckpt")
    for trainer in (straight, restored):
        trainer.train_step(with_old_logprobs(trainer, train_batch(1)), 1)
    a, b = _state(straight), _state(restored)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    plain = _trainer("float32")
    write_files(plain.save_checkpoint(), tmp_path / "plain")
    with pytest.raises(BadInput, match="expected the fp32 master weight"):
        _trainer("float32", optimizer_cpu_offload=True).load_checkpoint(tmp_path / "plain")


def test_the_memory_example_of_docs_usage_keeps_the_runs_bits(tmp_path):
    """docs/usage.md's memory TOML on a small bf16 run through the CLI: the same checksums.jsonl, step by step,
    as the run without it, and the manifest records the three settings."""
    import tomllib

    block = re.search(r"```toml\n(\[train\]\nrecompute = true\n[^`]*)```", (REPO / "docs" / "usage.md").read_text())
    base = small_toml(2) + '[model]\ndtype = "bfloat16"\n'
    saving = base
    for section, values in tomllib.loads(block[1]).items():  # into small_toml's own sections
        lines = "".join(f"{key} = {str(value).lower()}\n" for key, value in values.items())
        saving = saving.replace(f"[{section}]\n", f"[{section}]\n{lines}", 1)
    sums = []
    for name, text in (("plain", base), ("saving", saving)):
        (tmp_path / f"{name}.toml").write_text(text)
        res = cli("run", "-c", str(tmp_path / f"{name}.toml"), "--out", str(tmp_path / name), "--json")
        assert res.returncode == 0, res.stderr
        sums.append((tmp_path / name / "checksums.jsonl").read_text())
    assert sums[0] == sums[1] and len(sums[0].splitlines()) == 2
    config = json.loads((tmp_path / "saving" / "manifest.json").read_text())["config"]
    assert config["train"]["recompute"] and config["train"]["optimizer_cpu_offload"] and config["rollout"]["offload"]


def test_the_offloaded_engine_lets_go_after_each_rollout_and_generates_the_same():
    """The engine behind `rollout.offload` drops its kept prefills after each generate and answers as the engine
    does (on the CPU its weights stay where they are: host memory already)."""
    from rlbench.backends.engine_memory import OffloadedEngine
    from rlbench.backends.hf_engine import HFEngine
    from rlbench.backends.prompt_cache import PromptCache
    from rlbench.core.types import GenerateRequest

    model = build_model(RANDOM_INIT_MODEL, master_seed=1, dtype="float32", init="random")
    plain, inner = HFEngine(model, batch_size=8), HFEngine(model, batch_size=8)
    inner.prompt_cache = PromptCache(1 << 30)
    engine = OffloadedEngine(inner)
    requests = [GenerateRequest((5, 6, 7 + i), 40 + i, 4, 1.0, (2,)) for i in range(3)]
    assert engine.generate(requests) == plain.generate(requests)
    assert len(inner.prompt_cache) == 0 and not engine.away and engine.engine_id == inner.engine_id
    assert engine.weight_checksums() == plain.weight_checksums()


@pytest.mark.parametrize(
    "overrides, field, says",
    [
        (
            {"train__backend": "megatron", "train__optimizer_cpu_offload": True},
            "train.optimizer_cpu_offload",
            "megatron",
        ),
        ({"rollout__backend": "sglang", "rollout__offload": True}, "rollout.offload", "servers' memory"),
        ({"rollout__async_mode": "one-step", "rollout__offload": True}, "rollout.offload", "async rollouts"),
        ({"train__recompute": 1}, "train.recompute", "true or false"),
    ],
)
def test_settings_that_cannot_hold_are_refused_by_name(overrides, field, says):
    with pytest.raises(BadInput) as info:
        load_config(**overrides)
    assert info.value.field == field and says in str(info.value)


def test_megatron_recomputes_through_its_transformer_config():
    """train.recompute with the megatron trainer is megatron-core's full, uniform recompute of every layer; the
    [train.megatron] table may not set those fields besides."""
    from rlbench.backends.megatron.model import RECOMPUTE, overrides_of

    train = load_config(
        train__backend="megatron", train__recompute=True, train__megatron={"fp32_residual_connection": False}
    ).train
    assert overrides_of(train) == {"fp32_residual_connection": False, **RECOMPUTE}
    clash = dataclasses.replace(train, megatron={"recompute_num_layers": 2})
    with pytest.raises(BadInput, match="set by train.recompute") as info:
        overrides_of(clash)
    assert info.value.field == "train.megatron.recompute_num_layers"
    # held to megatron-core's own TransformerConfig (0.16.1, transformer_config.py's __post_init__): it takes the
    # three fields, and refuses full granularity without a method, as slime_args refuses the slime flag alone
    pytest.importorskip("megatron.core")
    from rlbench.backends.megatron import model as mmodel
    from rlbench.core.model import load_model_config

    config = load_config()
    hf = load_model_config(config.model.path)
    dims = mmodel.dims_of(hf, 1, config.model.path)
    made = mmodel.transformer_config(hf, dims, 1, False, "cpu", overrides_of(train))
    assert (made.recompute_granularity, made.recompute_method, made.recompute_num_layers) == ("full", "uniform", 1)
    with pytest.raises(BadInput, match="recompute_method must be"):
        mmodel.transformer_config(hf, dims, 1, False, "cpu", {"recompute_granularity": "full"})
