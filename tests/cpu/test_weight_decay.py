"""Weight decay by Megatron's rule, which slime trains with: biases and 1-D parameters (norms) take none, every
other parameter takes train.weight_decay. Both trainers' AdamW param groups are megatron-core's own
(`_get_param_groups`, parameter by parameter, in its order); a step of decay alone moves the matrices and
leaves the norms; a checkpoint whose groups decay otherwise (one written before the rule with weight decay
> 0) is refused by name, and the old one-group checkpoint at weight decay 0 still loads."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from rlbench.backends.torch_trainer import TorchTrainer
from rlbench.backends.optimizer_state import check_weight_decays, decay_groups, decays
from rlbench.config import load_config
from rlbench.core.model import build_model
from rlbench.errors import BadInput
from tests.conftest import cli, small_toml
from tests.helpers import train_batch, with_old_logprobs, write_files
from tests.conftest import RANDOM_INIT_MODEL


def _trainer(weight_decay: float, dtype: str = "float32", seed: int = 1) -> TorchTrainer:
    # no KL term (the default's kl_coef is 0.1 since issue 52): these batches carry no reference log-probs (the
    # loop computes them), and what is tested here does not depend on the KL term
    config = load_config(algo__kl_coef=0.0)
    model = build_model(RANDOM_INIT_MODEL, master_seed=seed, dtype=dtype, init="random")
    return TorchTrainer(model, dataclasses.replace(config.train, weight_decay=weight_decay), config.algo, 1.0, seed=0)


def _megatron_groups(module: torch.nn.Module) -> list[tuple[float, list[str]]]:
    """megatron-core's own param groups of `module` (slime's call: the standard overrides), as (wd_mult, names)."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    names = {id(p): name for name, p in module.named_parameters()}
    groups = _get_param_groups([module], OptimizerConfig(lr=1e-3, weight_decay=0.1), None)
    return [(group["wd_mult"], [names[id(p)] for p in group["params"]]) for group in groups]


def _groups(optimizer: torch.optim.Optimizer, named: dict[str, torch.Tensor]) -> list[tuple[float, list[str]]]:
    names = {id(p): name for name, p in named.items()}
    return [(group["weight_decay"], [names[id(p)] for p in group["params"]]) for group in optimizer.param_groups]


def _as_mults(groups: list[tuple[float, list[str]]], weight_decay: float) -> list[tuple[float, list[str]]]:
    return [(wd / weight_decay, names) for wd, names in groups]


class _Biased(torch.nn.Module):
    """A bias that is 2-D, a 1-D weight that is no norm, a linear layer with a bias: the rule's corners."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.table = torch.nn.Module()
        self.table.bias = torch.nn.Parameter(torch.zeros(2, 2))
        self.scale = torch.nn.Parameter(torch.ones(5))


def test_the_rule_on_names_and_shapes():
    assert decays("model.layers.0.mlp.up_proj.weight", (8, 4))
    assert not decays("model.norm.weight", (4,))  # 1-D
    assert not decays("linear.bias", (3,)) and not decays("table.bias", (2, 2))  # a bias, whatever its shape
    assert decays("a.biased", (2, 2))  # ".bias" ends the name, or it is no bias
    weights = {"w": torch.zeros(2, 2), "norm": torch.zeros(2)}
    assert [g["weight_decay"] for g in decay_groups(weights, 0.1)] == [0.1, 0.0]
    assert [g["weight_decay"] for g in decay_groups({"w": weights["w"]}, 0.1)] == [0.1]  # no empty group


def test_the_torch_trainers_groups_are_megatron_cores(one_rank):
    """On the Hugging Face model (float32: its parameters; bf16: the fp32 masters, by name) and on a module of
    the rule's corners, rlbench's groups are megatron-core's, parameter by parameter and in its order."""
    for dtype in ("float32", "bfloat16"):
        trainer = _trainer(0.1, dtype)
        named = trainer.masters.params if trainer.masters else dict(trainer.model.named_parameters())
        ours = _as_mults(_groups(trainer.optimizer, named), 0.1)
        assert ours == _megatron_groups(trainer.model), dtype
        assert [len(names) for _, names in ours] == [1 + 2 * 7, 2 * 4 + 1]  # embedding + 7 matrices a layer; norms
    corners = _Biased()
    named = dict(corners.named_parameters())
    optimizer = torch.optim.AdamW(decay_groups(named, 0.1), lr=1e-3, weight_decay=0.1, fused=True)
    assert _as_mults(_groups(optimizer, named), 0.1) == _megatron_groups(corners)
    assert _groups(optimizer, named) == [(0.1, ["linear.weight"]), (0.0, ["scale", "linear.bias", "table.bias"])]


def test_the_megatron_trainers_groups_are_megatron_cores(tmp_path):
    """The megatron trainer (TP=1, in-process) over megatron-core's DistributedDataParallel: its AdamW's groups
    are the very parameters megatron-core's `_get_param_groups` puts in each. Its checkpoint records them, and
    one that decays otherwise is refused on rank 0 (layout.json, by field) before any rank loads."""
    pytest.importorskip("megatron.core")
    from rlbench.backends.megatron.trainer import check_layout_weight_decays
    from rlbench.backends.registry import make_trainer

    config = load_config(train__backend="megatron", train__weight_decay=0.1)
    trainer = make_trainer(config, build_model(RANDOM_INIT_MODEL, master_seed=1, init="random"))
    try:
        trainer.export_hf_weights()  # the ranks start at the first call
        rank = trainer._local
        named = dict(rank.model.named_parameters())
        ours = _as_mults(_groups(rank.optimizer, named), 0.1)
        assert ours == _megatron_groups(rank.model)
        assert [len(names) for _, names in ours] == [1 + 2 * 4, 2 * 4 + 1]  # embedding + 4 fused matrices a layer
        write_files(trainer.save_checkpoint(), tmp_path / "ckpt")
    finally:
        trainer.close()
    layout_path = tmp_path / "ckpt" / "layout.json"
    layout = json.loads(layout_path.read_text())
    assert [g["weight_decay"] for g in layout["optimizer"]["param_groups"]] == [0.1, 0.0]
    check_layout_weight_decays(tmp_path / "ckpt", 0.1)
    with pytest.raises(
        BadInput,
        match=r"layout\.json: optimizer\.param_groups: .*\[0\.1, 0\.0\], this run's \[0\.0, "
        r"0\.0\]",
    ):
        check_layout_weight_decays(tmp_path / "ckpt", 0.0)
    for saved, ok in (([0.1], False), ([0.0], True)):  # one group: a checkpoint of rlbench before the rule
        layout["optimizer"]["param_groups"] = [{**layout["optimizer"]["param_groups"][0], "weight_decay": saved[0]}]
        layout_path.write_text(json.dumps(layout))
        if ok:
            check_layout_weight_decays(tmp_path / "ckpt", 0.0)
        else:
            with pytest.raises(BadInput, match=r"weight decays \[0\.1\], this run's \[0\.1, 0\.0\]"):
                check_layout_weight_decays(tmp_path / "ckpt", 0.1)


def test_decay_alone_moves_the_matrices_and_leaves_the_norms():
    """One AdamW step with every gradient zero is weight decay alone: each 2-D weight becomes w * (1 - lr * wd)
    (to a rounding), each 1-D one (the norms) stays bit for bit. Without the rule the norms would shrink too."""
    trainer = _trainer(0.1)
    lr = trainer.train_config.lr
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    for p in trainer.model.parameters():
        p.grad = torch.zeros_like(p)
    trainer.optimizer_step()
    for name, p in trainer.model.named_parameters():
        if p.dim() == 1:
            assert torch.equal(p, before[name]), name
        else:
            assert not torch.equal(p, before[name]), name
            torch.testing.assert_close(p.detach(), before[name] * (1 - lr * 0.1), rtol=1e-6, atol=0)


def _one_group(path, weight_decay: float) -> None:
    """Rewrite optimizer.json as rlbench wrote it before the rule: one param group holding every parameter."""
    meta = json.loads(path.read_text())
    meta["param_groups"] = [{**meta["param_groups"][0], "weight_decay": weight_decay}]
    path.write_text(json.dumps(meta))


def test_a_one_group_checkpoint_loads_at_weight_decay_0_and_resumes_bit_for_bit(tmp_path):
    straight = _trainer(0.0)
    straight.train_step(with_old_logprobs(straight, train_batch(0)), step=0)
    write_files(straight.save_checkpoint(), tmp_path / "ckpt")
    straight.train_step(with_old_logprobs(straight, train_batch(1)), step=1)
    _one_group(tmp_path / "ckpt" / "optimizer.json", 0.0)
    restored = _trainer(0.0, seed=2)
    restored.load_checkpoint(tmp_path / "ckpt")
    restored.train_step(with_old_logprobs(restored, train_batch(1)), step=1)
    for (name, a), (_, b) in zip(straight.model.named_parameters(), restored.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_checkpoint_that_decays_otherwise_is_refused(tmp_path):
    """`rlbench run --resume` of a run at weight decay 0.1: its own checkpoint (two groups) resumes to the straight
    run's checksums; the same checkpoint as rlbench wrote it before the rule (one group, 0.1 on the norms too) is
    refused in one line naming optimizer.json and param_groups, exit 2."""
    (tmp_path / "s.toml").write_text(small_toml(3).replace("[train]\n", "[train]\nweight_decay = 0.1\n"))
    res = cli("run", "-c", str(tmp_path / "s.toml"), "--out", str(tmp_path / "a"), "--json")
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "a" / "checkpoints" / "000002" / "optimizer.json").read_text())
    assert [g["weight_decay"] for g in meta["param_groups"]] == [0.1, 0.0]
    for old in (False, True):
        resumed = shutil.copytree(tmp_path / "a", tmp_path / f"r{old}")
        lines = (resumed / "metrics.jsonl").read_text().splitlines(keepends=True)
        (resumed / "metrics.jsonl").write_text("".join(lines[:2]))
        if old:
            _one_group(resumed / "checkpoints" / "000002" / "optimizer.json", 0.1)
        res = cli("run", "--resume", str(resumed))
        if old:
            assert res.returncode == 2, res.stderr
            lines = res.stderr.strip().splitlines()
            assert (
                len(lines) == 1
                and "000002/optimizer.json: param_groups: the saved optimizer's param groups "
                "have weight decays [0.1], this run's [0.1, 0.0]"
                in lines[0]
            ), res.stderr
        else:
            assert res.returncode == 0, res.stderr
            assert (resumed / "checksums.jsonl").read_bytes() == (tmp_path / "a" / "checksums.jsonl").read_bytes()
    with pytest.raises(BadInput, match=r"x\.json: param_groups: expected a list"):
        check_weight_decays({"scalars": {}}, [0.0], tmp_path / "x.json")  # no param groups: not guessed
