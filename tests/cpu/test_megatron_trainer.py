"""The megatron trainer at TP=1, in-process: bitwise reruns, agreement with the torch trainer at
step 0 and where they part, replay, refused settings, and the weight-update check (for every
trainer) stopping a run whose conversion or engine loader is broken.
Multi-rank runs (TP=2, DP=2, SIGKILL and resume) are in test_megatron_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlbench.config import apply_overrides, load_config
from rlbench.session import run
from rlbench.errors import BadInput, WeightMismatch
from rlbench.rundir.directory import read_run
from rlbench.rundir.recording import read_step
from tests.conftest import RANDOM_INIT_MODEL, run_cli, small_toml

SEED = 7  # step 0 of the small config has a reward signal at this seed (a non-zero loss)


def _config(out: Path, **overrides):
    # The fixture model from random weights, lr 1e-3 and no KL term, the defaults before issue 52: the agreement with
    # the torch trainer was measured on them (from the warm-started default policy both trainers' step-0 log-probs
    # are the same bits, and the first stage where they part is the loss, not old_logprobs).
    base = load_config(
        seed=SEED,
        model__path=str(RANDOM_INIT_MODEL),
        model__init="random",
        algo__kl_coef=0.0,
        train__lr=1e-3,
        steps=3,
        checkpoint_every=2,
        data__prompts_per_step=2,
        rollout__n_samples_per_prompt=4,
        train__minibatches=2,
        train__micro_batch_size=3,
        reward__custom_rm_path="tests.cpu.plugins.rewards.response_length",
    )
    # The dense reward gives every minibatch a loss well away from 0 (the default task's step-0 rewards are
    # nearly all 0, and so are its losses, where a relative tolerance would measure only rounding noise).
    return apply_overrides(base, out=str(out), **{"train__backend": "megatron", **overrides})


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in ("manifest.json", "metrics.jsonl")
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    for name in ("a", "b"):
        run(_config(root / name))
    run(_config(root / "torch", train__backend="torch"))
    return root


def test_reruns_are_bit_identical(runs):
    a, b = _files(runs / "a"), _files(runs / "b")
    assert sorted(a) == sorted(b) and "checkpoints/000002/model-tp00.safetensors" in a
    assert [name for name in a if a[name] != b[name]] == []

    def strip(run):
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_run(run).metrics]

    assert strip(runs / "a") == strip(runs / "b")
    res = run_cli("diff", str(runs / "a"), str(runs / "b"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no difference (bit for bit): 3 steps x 10 stages" in res.stdout
    assert "checkpoints verified: A 3, B 3" in res.stdout  # 0, 2 and the last, 3: layout.json's kind
    manifest = json.loads((runs / "a" / "manifest.json").read_text())
    assert manifest["versions"]["megatron-core"] is not None


def test_recompute_keeps_the_bits(runs, tmp_path):
    """train.recompute (megatron-core's full recompute of each layer): every step's checksums as without it."""
    run(_config(tmp_path / "recompute", train__recompute=True))
    assert (tmp_path / "recompute" / "checksums.jsonl").read_bytes() == (runs / "a" / "checksums.jsonl").read_bytes()


@pytest.mark.parametrize("name", ["model-tp00.safetensors", "optimizer-tp00.safetensors"])
def test_diff_refuses_a_megatron_checkpoint_with_a_flipped_bit(runs, tmp_path, name):
    """A model shard is held to the verified model.safetensors (rank 0's part of it), an optimizer shard to
    layout.json's shard checksums: one flipped bit is bad input naming the file, not "no difference"."""
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(runs / "b", copy)
    path = copy / "checkpoints" / "000003" / name
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(bytes(raw))
    res = run_cli("diff", str(runs / "a"), str(copy))
    assert res.returncode == 2 and str(path) in res.stderr and "Traceback" not in res.stderr, res.stdout + res.stderr


def test_step0_losses_match_the_torch_trainer_and_diff_names_where_they_part(runs):
    mega, torch_run = read_step(runs / "a", 0)[0], read_step(runs / "torch", 0)[0]
    assert torch.equal(mega["tokens"], torch_run["tokens"])  # same engine, same initial weights
    losses_m, losses_t = mega["losses"].double(), torch_run["losses"].double()
    assert bool((losses_t != 0).any())
    assert float(((losses_m - losses_t).abs() / losses_t.abs().clamp(min=1e-30)).max()) <= 1e-5
    res = run_cli("diff", str(runs / "torch"), str(runs / "a"), "--json")
    assert res.returncode == 1, res.stderr
    first = json.loads(res.stdout)["first"]
    assert (first["step"], first["stage"]) == (0, "old_logprobs")  # the first stage the trainer computes
    assert first["where"].startswith("sample ") and "token" in first["where"]
    assert 0 < first["max_abs"] < 1e-5
    assert json.loads(res.stdout)["advice"] is None  # one layout (tp 1, dp 1) and dtype: no float64 advice


def test_replay_reproduces_a_megatron_run(runs, tmp_path):
    from rlbench.replay.replay import replay

    res = replay(runs / "a", tmp_path / "replay")
    assert res.ok and res.reproduced == 3, res.diverged


def test_train_only_from_a_megatron_recording(runs, tmp_path):
    """The recording's initial weights come from its checkpoint 0 (model.safetensors, HF names)."""
    from rlbench.replay.replay import train_only_config

    config = train_only_config(_config(tmp_path / "t", mode="train-only", rollouts=str(runs / "a")), runs / "a", None)
    result = run(config)
    assert [h["train/loss"] for h in result.history] == [row["train/loss"] for row in read_run(runs / "a").metrics]


def test_kl_to_the_reference_policy(tmp_path):
    """The reference is its own GPTModel shard with the initial weights: at step 0 it agrees with
    the policy bit for bit; after the first optimizer step the KL is positive."""
    result = run(_config(tmp_path / "kl", steps=1, algo__kl_coef=0.1))
    tensors = read_step(tmp_path / "kl", 0)[0]
    assert torch.equal(tensors["ref_logprobs"], tensors["old_logprobs"])
    assert result.history[0]["train/kl_loss"] > 0


@pytest.fixture
def no_rank_starts(monkeypatch):
    """Fails the test if a worker rank process is started."""
    from rlbench.backends.megatron import launch

    def refuse(self, port, world, device):
        raise AssertionError(f"{world - 1} worker rank(s) started before the settings were refused")

    monkeypatch.setattr(launch.Processes, "start", refuse)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"train__megatron": {"no_such_field": 1}},
            "train.megatron.no_such_field: not a field of megatron-core's TransformerConfig that a config sets",
        ),
        ({"train__megatron": {"hidden_size": 32}}, "hidden_size: set from the model's config.json or by rlbench"),
        ({"tp": 4}, "num_key_value_heads: 2 does not divide by the tensor-parallel size 4"),
        (
            {"train__megatron": {"sequence_parallel": 1}},
            "train.megatron.sequence_parallel: expected true or false, got 1",
        ),
        (
            {"train__megatron": {"init_method_std": "0.02"}},
            "train.megatron.init_method_std: expected a finite number, got '0.02'",
        ),
        ({"train__megatron": {"init_method_std": float("nan")}}, "init_method_std: expected a finite number, got nan"),
        ({"train__megatron": {"num_moe_experts": True}}, "num_moe_experts: expected an integer, got True"),
        (
            {"train__megatron": {"recompute_granularity": "most"}},
            "recompute_granularity: expected one of 'full', 'selective', got 'most'",
        ),
        ({"train__megatron": {"window_size": [4]}}, "window_size: expected a list of 2 integers, got [4]"),
        (
            {"train__megatron": {"init_method": "normal"}},
            "train.megatron.init_method: expected Callable (a Python object, which a TOML table cannot give), "
            "got 'normal'",
        ),
        (
            {"train__megatron": {"attention_backend": "flash"}},
            "attention_backend: expected AttnBackend (an enum, which a TOML table cannot give), got 'flash'",
        ),
        (
            {"train__megatron": {"bf16": True}},
            "train.megatron.bf16: expected false on the CPU, got True: the megatron "
            "trainer trains in model.dtype (float32, float64, or bfloat16 over fp32 "
            "masters) there (megatron-core's bf16 flag is its GPU path)",
        ),
        (
            {"model__dtype": "bfloat16", "train__megatron": {"bf16": False}},
            'train.megatron.bf16: set by model.dtype = "bfloat16", not here',
        ),
        ({"train__megatron": {"fp16": True}}, "train.megatron.fp16: expected false on the CPU"),
        ({"train__megatron": {"fp8": "e4m3"}}, "train.megatron.fp8: expected unset on the CPU, got 'e4m3'"),
        ({"train__megatron": {"num_attention_heads": 3}}, "num_attention_heads: set from the model's config.json"),
        (
            {"train__megatron": {"fp8_param": True}},
            "train.megatron: megatron-core refused the settings (ValueError: fp8_param must be used together "
            "with fp8 mode.)",
        ),
        ({"dp": 5}, "tp * dp: expected at most 4 ranks (a CPU each: this machine has 4), got tp 1 x dp 5 = 5"),
        ({"tp": 2, "dp": 512}, "tp * dp: expected at most 4 ranks"),
    ],
)
def test_refused_before_anything_starts(tmp_path, monkeypatch, no_rank_starts, overrides, message):
    from rlbench.backends import registry

    monkeypatch.setattr(registry, "available_cpus", lambda: 4)  # the same refusals on any machine
    with pytest.raises(BadInput) as info:
        run(_config(tmp_path / "bad", **overrides))
    assert message in str(info.value)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--dp", "1024"), "got tp 1 x dp 1024 = 1024"),
        (("--tp", "2", "--dp", "512"), "got tp 2 x dp 512 = 1024"),
        (("--dp", "64"), "got tp 1 x dp 64 = 64"),
    ],
)
def test_more_ranks_than_the_machine_has_is_one_line_and_starts_nothing(
    tmp_path, monkeypatch, no_rank_starts, args, needle
):
    from rlbench.backends import registry
    from tests.conftest import cli

    monkeypatch.setattr(registry, "available_cpus", lambda: 2)  # a 2-core machine, as the issue's
    res = cli("run", "--trainer", "megatron", *args, "--out", str(tmp_path / "o"))
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("rlbench: error: tp * dp: expected at most 2 ranks ") and needle in lines[0]
    assert not (tmp_path / "o").exists()


def test_every_settable_field_takes_its_own_default():
    """The type check holds to megatron-core's own declarations: every TransformerConfig field rlbench
    leaves to the table takes its default (where TOML can say it) and refuses a value of another kind."""
    import dataclasses
    import typing

    from rlbench.backends.megatron import settings
    from rlbench.backends.megatron.model import quiet

    with quiet():
        from megatron.core.transformer.transformer_config import TransformerConfig
    hints = typing.get_type_hints(TransformerConfig)
    checked = 0
    for f in dataclasses.fields(TransformerConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        default = list(default) if isinstance(default, tuple) else default
        if not f.init or f.name in settings.OWNED or not isinstance(default, (bool, int, float, str, list)):
            continue
        assert settings.fits(default, hints[f.name]), f.name
        odd = {bool: 1, int: True, float: "1.0", str: 1}.get(type(default), "x")
        assert not settings.fits(odd, hints[f.name]), (f.name, odd)
        checked += 1
    assert checked > 150


def test_the_megatron_table_passes_through():
    from rlbench.backends.megatron import model as mmodel
    from rlbench.core.model import load_model_config

    hf_config = load_model_config(load_config().model.path)
    dims = mmodel.dims_of(hf_config, 1, load_config().model.path)
    tconfig = mmodel.transformer_config(hf_config, dims, 1, False, "cpu", {"init_method_std": 0.5})
    assert tconfig.init_method_std == 0.5 and tconfig.num_query_groups == 2  # theirs, and the model's


def test_settings_the_megatron_trainer_cannot_take():
    with pytest.raises(BadInput, match="tp"):
        load_config(tp=2)  # the torch trainer
    with pytest.raises(BadInput, match="true_on_policy"):
        load_config(train__backend="megatron", rollout__true_on_policy=True)
    with pytest.raises(BadInput, match=r"train\.megatron"):
        load_config(train__megatron={"deterministic_mode": True})  # a Megatron table for the torch trainer


def test_a_checkpoint_of_another_layout_is_refused(runs):
    from rlbench.backends.megatron.convert import Dims
    from rlbench.backends.megatron.trainer import check_layout

    checkpoint = runs / "a" / "checkpoints" / "000002"
    layout = json.loads((checkpoint / "layout.json").read_text())
    check_layout(checkpoint, 1, Dims(**layout["dims"]))
    with pytest.raises(BadInput, match="tp"):
        check_layout(checkpoint, 2, Dims(**layout["dims"]))


def test_weight_check_stops_a_broken_conversion_at_step_0(tmp_path, monkeypatch):
    """k and v swapped in the Megatron -> HF split of the fused QKV: the trainer's first export is
    not the model the engine loaded, and the run stops before step 0, exit 1, naming where."""
    (tmp_path / "s.toml").write_text(small_toml(3))
    monkeypatch.setenv("RLBENCH_MEGATRON_FAULT", "swap-kv-split")
    res = run_cli(
        "run", "-c", str(tmp_path / "s.toml"), "--trainer", "megatron", "--out", str(tmp_path / "run"), "--json"
    )
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlbench: check failed: before step 0, first sync:"), res.stderr
    assert "model.layers.0.self_attn.k_proj.weight[0, 0] (element 0 of 2048)" in lines[0]
    assert lines[0].endswith("; 4 tensors differ")  # k and v of both layers
    assert not (tmp_path / "run").exists()  # nothing was committed: no --out is left behind


def test_weight_check_holds_the_torch_trainers_engine_too(tmp_path, monkeypatch, run_small):
    """An engine loader that drops one value after the first update: caught at step 0's sync."""
    from rlbench.backends.hf_engine import HFEngine

    loader = HFEngine.update_weights

    def lossy(self, weights, version):
        loader(self, weights, version)
        if version >= 1:
            with torch.no_grad():
                self.model.model.norm.weight[5] = 0.0

    monkeypatch.setattr(HFEngine, "update_weights", lossy)
    with pytest.raises(
        WeightMismatch,
        match=r"step 0, sync: engine weights differ from the trainer's at "
        r"model\.norm\.weight\[5\] \(element 5 of 64\): trainer ",
    ):
        run_small("lossy")
    assert not (tmp_path / "lossy").exists()  # nothing was committed: no --out is left behind


def test_first_difference_compares_bytes():
    from rlbench.core.weight_check import first_difference

    a = {"w": torch.tensor([[1.0, 0.0], [2.0, 3.0]]), "v": torch.zeros(3)}
    assert first_difference(a, {k: t.clone() for k, t in a.items()}, ("a", "b")) is None
    b = {"w": torch.tensor([[1.0, -0.0], [2.0, 3.5]]), "v": torch.zeros(3)}  # -0.0 == 0.0, but not in bytes
    assert first_difference(a, b, ("a", "b")) == "w[0, 1] (element 1 of 4): a 0.0, b -0.0"
    assert "only the b's ['u']" in first_difference(a, {**a, "u": torch.zeros(1)}, ("a", "b"))
    assert "float64" in first_difference(a, {**a, "v": torch.zeros(3, dtype=torch.float64)}, ("a", "b"))
