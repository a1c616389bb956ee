"""The embedded trainer at real sizes (issue 24): a bf16 model trains over fp32 master weights as Megatron's
optimizer does it (fp32 gradients summed over micro-batches, fp32 AdamW, the masters rounded into the model), its
checkpoint restores the masters exactly and refuses a flipped bit; micro-batches sized by tokens pack as slime's
first-fit (`--use-dynamic-batch-size --max-tokens-per-gpu`) and train the same minibatch to rounding."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from rlbench.backends.torch_trainer import TorchTrainer
from rlbench.config import load_config
from rlbench.core.model import build_model
from rlbench.errors import BadInput
from tests.helpers import train_batch, with_old_logprobs, write_files
from tests.conftest import RANDOM_INIT_MODEL


def _trainer(dtype: str = "bfloat16", lr: float = 1e-3, **train) -> TorchTrainer:
    # no KL term (the default's kl_coef is 0.1 since issue 52): these batches carry no reference log-probs (the
    # loop computes them), and what is tested here does not depend on the KL term
    config = load_config(algo__kl_coef=0.0)
    model = build_model(RANDOM_INIT_MODEL, master_seed=1, dtype=dtype, init="random")
    return TorchTrainer(model, dataclasses.replace(config.train, lr=lr, **train), config.algo, 1.0, seed=0)


def test_bf16_trains_over_fp32_masters():
    """The optimizer holds fp32 masters and fp32 state; gradients reach the masters in fp32 and the model's
    parameters are the masters rounded to bf16 after the step. With an update below bf16's resolution (lr 1e-6)
    the masters move and the bf16 weights may not: pure bf16 AdamW would lose that update altogether."""
    trainer = _trainer(lr=1e-6)
    assert trainer.masters is not None
    assert all(p.dtype == torch.float32 for group in trainer.optimizer.param_groups for p in group["params"])
    before = {name: p.detach().clone() for name, p in trainer.masters.params.items()}
    stats = trainer.train_step(with_old_logprobs(trainer, train_batch(0)), 0)
    assert torch.isfinite(stats.losses).all()
    moved = [name for name, p in trainer.masters.params.items() if not torch.equal(p, before[name])]
    assert len(moved) == len(before)
    for name, param in trainer.model.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, trainer.masters.params[name].to(torch.bfloat16))
    state = next(iter(trainer.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32
    assert _trainer("float32").masters is None  # a float32 model trains as it is


def test_gradients_add_up_in_fp32_across_micro_batches():
    """Two micro-batches of 8 and one of 16 give fp32 master gradients equal to rounding (each micro-batch's bf16
    gradient is added into fp32; nothing is accumulated in bf16)."""
    grads = []
    for micro in (8, 16):
        trainer = _trainer(micro_batch_size=micro, minibatches=1)
        trainer.optimizer.step = lambda: None  # keep the gradients to compare
        trainer.masters.copy_to_model = lambda: None
        trainer.train_step(with_old_logprobs(trainer, train_batch(0)), 0)
        grads.append({name: p.grad.clone() for name, p in trainer.masters.params.items()})
    for name, grad in grads[0].items():
        assert grad.dtype == torch.float32
        assert float((grad - grads[1][name]).norm() / grads[1][name].norm()) < 2e-2, name  # bf16 forwards
    # The sum itself is fp32: 1 + 2**-10 is exact there and rounds back to 1 in bf16 (8 significant bits).
    from rlbench.backends.master_weights import MasterWeights

    layer = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    masters = MasterWeights(layer)
    for scale in (1.0, 2.0**-10):  # two micro-batches: d(scale * w * 1)/dw = scale, each exact in bf16
        (layer(torch.ones(1, 1, dtype=torch.bfloat16)) * scale).sum().backward()
    assert masters.params["weight"].grad.item() == 1.0 + 2.0**-10 and layer.weight.grad is None


def test_a_mixed_precision_checkpoint_resumes_exactly_and_refuses_a_flipped_bit(tmp_path):
    straight = _trainer()
    straight.train_step(with_old_logprobs(straight, train_batch(0)), 0)
    write_files(straight.save_checkpoint(), tmp_path / "ckpt")
    restored = _trainer()
    restored.load_checkpoint(tmp_path / "ckpt")
    for trainer in (straight, restored):
        trainer.train_step(with_old_logprobs(trainer, train_batch(1)), 1)
    for name, p in straight.masters.params.items():
        assert torch.equal(p, restored.masters.params[name]), name
    from safetensors.torch import load_file, save_file

    for file, prefix in (("model.safetensors", "model."), ("optimizer.safetensors", "master/")):
        damaged = shutil.copytree(tmp_path / "ckpt", tmp_path / f"damaged-{file}")
        tensors = load_file(damaged / file)
        name = sorted(k for k in tensors if k.startswith(prefix))[0]
        raw = tensors[name].clone().reshape(-1).view(torch.uint8)
        raw[raw.numel() // 2] ^= 1
        tensors[name] = raw.view(tensors[name].dtype).reshape(tensors[name].shape)
        save_file(tensors, damaged / file)
        with pytest.raises(BadInput) as info:
            _trainer().load_checkpoint(damaged)
        assert str(info.value).startswith(str(damaged / file)), str(info.value)


def test_token_micro_batches_pack_first_fit_as_slime():
    """slime's first_fit_pack (slime/utils/seqlen_balancing.py, THUDM/slime 624b824a): each sample goes into the
    first micro-batch it fits under the cap, in order; a sample longer than the cap sits alone."""
    trainer = _trainer("float32", max_tokens_per_micro_batch=10)
    assert trainer._micro_batches([4, 7, 3, 5, 12, 1, 6]) == [[0, 2, 5], [1], [3], [4], [6]]
    assert trainer._micro_batches([5, 5, 5]) == [[0, 1], [2]]
    assert _trainer("float32", micro_batch_size=2)._micro_batches([1] * 5) == [range(0, 2), range(2, 4), range(4, 5)]


def test_token_micro_batches_train_the_same_minibatch_to_rounding():
    """The same samples in other micro-batches: the loss and every metric to float32 rounding (a per-sample loss:
    each micro-batch weighted by its share of the minibatch's samples)."""
    results = []
    for tokens in (None, 30):
        trainer = _trainer("float32", max_tokens_per_micro_batch=tokens, micro_batch_size=16)
        batch = with_old_logprobs(trainer, train_batch(0))
        batch.lengths = torch.tensor([12 - (i % 5) for i in range(16)])
        results.append(trainer.train_step(batch, 0))
    assert torch.allclose(results[0].losses, results[1].losses, rtol=1e-5)
    for key, value in results[0].metrics.items():
        assert results[1].metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def test_the_token_micro_batch_example_of_docs_usage_runs(tmp_path):
    """docs/usage.md's `[train]` TOML for token-sized micro-batches, on a small bf16 run: it trains, the manifest
    records the setting, and the checkpoint carries the fp32 masters and the optimizer tensors' checksum."""
    import json
    import re

    from tests.conftest import REPO, cli, small_toml

    text = (REPO / "docs" / "usage.md").read_text()
    block = re.search(r"```toml\n(\[train\]\nmax_tokens_per_micro_batch[^`]*)```", text).group(1)
    config = tmp_path / "c.toml"
    config.write_text(small_toml(2).replace("[train]\n", block, 1) + '[model]\ndtype = "bfloat16"\n')
    res = cli("run", "-c", str(config), "--out", str(tmp_path / "out"), "--json")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["config"]["train"]["max_tokens_per_micro_batch"] == 4096
    meta = json.loads((tmp_path / "out" / "checkpoints" / "000002" / "optimizer.json").read_text())
    assert meta["tensors_checksum"]
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "checkpoints" / "000002" / "optimizer.safetensors", "pt") as f:
        assert any(key.startswith("master/") for key in f.keys())


def test_the_megatron_trainer_in_bf16_trains_over_fp32_masters_and_resumes(tmp_path):
    """`--trainer megatron` with model.dtype bfloat16 (one rank, in-process): Megatron's mixed precision (bf16
    parameters, gradients reduced into fp32 buffers, fp32 masters and AdamW state); its checkpoint holds the masters
    with a checksum per optimizer shard: a resumed run writes the straight run's checksums, and a flipped bit in a
    master is refused in one line (exit 2). (TP=2 in bf16, resumed, by hand: the same checksums as straight.)"""
    pytest.importorskip("megatron.core")
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from rlbench.session import run
    from tests.conftest import cli

    config = load_config(
        steps=4,
        seed=3,
        checkpoint_every=2,
        model__dtype="bfloat16",
        train__backend="megatron",
        data__prompts_per_step=4,
        rollout__n_samples_per_prompt=4,
        train__minibatches=2,
        train__micro_batch_size=8,
        out=str(tmp_path / "a"),
    )
    run(config)
    a = tmp_path / "a"
    shard = a / "checkpoints" / "000002" / "optimizer-tp00.safetensors"
    tensors = load_file(shard)
    masters = {k: v for k, v in tensors.items() if k.startswith("master/")}
    assert masters and all(v.dtype == torch.float32 for v in masters.values())
    weights = load_file(a / "checkpoints" / "000002" / "model-tp00.safetensors")
    assert all(
        weights[k.removeprefix("master/")].dtype == torch.bfloat16
        and torch.equal(v.to(torch.bfloat16), weights[k.removeprefix("master/")])
        for k, v in masters.items()
    )
    assert json.loads((a / "checkpoints" / "000002" / "layout.json").read_text())["optimizer"]["shard_checksums"]
    for flip in (None, "optimizer", "model"):
        resumed = shutil.copytree(a, tmp_path / f"r{flip}")
        lines = (resumed / "metrics.jsonl").read_text().splitlines(keepends=True)
        (resumed / "metrics.jsonl").write_text("".join(lines[:3]))
        if flip is not None:
            source = tensors if flip == "optimizer" else weights
            name = sorted(masters)[0].removeprefix("master/" if flip == "model" else "")
            raw = source[name].clone().reshape(-1).view(torch.uint8)
            raw[1] ^= 1
            save_file(
                {**source, name: raw.view(source[name].dtype).reshape(source[name].shape)},
                resumed / "checkpoints" / "000002" / f"{flip}-tp00.safetensors",
            )
        res = cli("run", "--resume", str(resumed))
        if flip == "optimizer":
            assert res.returncode == 2 and "optimizer-tp00.safetensors: its tensors do not match" in res.stderr
        elif flip == "model":
            assert res.returncode == 2 and "model-tp00.safetensors: '" in res.stderr, res.stderr
            assert "is not its fp32 master weight rounded" in res.stderr
        else:
            assert res.returncode == 0, res.stderr
            assert (resumed / "checksums.jsonl").read_bytes() == (a / "checksums.jsonl").read_bytes()
