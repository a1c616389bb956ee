"""slime's command line, read by `rlbench run` as slime reads it: each case of expected_args.json
(what slime's own parser and slime_validate_args resolved it to, at the commit recorded there) is
resolved by rlbench/slime_args.py, and every setting rlbench models is held to slime's value.
An argument rlbench does not model is refused by name; slime's own refusals are rlbench's."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from rlbench import slime_args
from rlbench.command import with_slime
from rlbench.config import load_config
from rlbench.errors import BadInput
from tests.conftest import cli

EXPECTED = json.loads((Path(__file__).parent / "expected_args.json").read_text())


ROOT = Path(__file__).resolve().parents[3]


def _config(argv: list[str]):
    argv = [str(ROOT / arg) if arg.endswith(".yaml") else arg for arg in argv]  # the repository's role config
    overrides, _ = with_slime(None, {}, slime_args.parse(argv))
    return load_config(**overrides)


def _slime_view(config) -> dict:
    """rlbench's config in slime's terms: what each slime setting became."""
    samples = config.data.prompts_per_step * config.rollout.n_samples_per_prompt
    return {
        "prompt_data": config.data.path,
        "input_key": config.data.prompt_key,
        "label_key": config.data.label_key,
        "apply_chat_template": config.data.apply_chat_template,
        "apply_chat_template_kwargs": config.data.chat_template_kwargs,
        "rollout_shuffle": config.data.shuffle,
        "rollout_batch_size": config.data.prompts_per_step,
        "n_samples_per_prompt": config.rollout.n_samples_per_prompt,
        "global_batch_size": samples // config.train.minibatches,
        "num_rollout": config.steps,
        "rollout_max_response_len": config.rollout.max_new_tokens,
        "rollout_temperature": config.rollout.temperature,
        "rollout_top_p": config.rollout.top_p,
        "rollout_top_k": config.rollout.top_k,
        "rollout_seed": config.rollout.sampling_seed,
        "rollout_stop_token_ids": list(config.rollout.stop_token_ids),
        "seed": config.seed,
        "lr": config.train.lr,
        "weight_decay": config.train.weight_decay,
        "adam_beta1": config.train.betas[0],
        "adam_beta2": config.train.betas[1],
        "adam_eps": config.train.adam_eps,
        "clip_grad": config.train.grad_clip,
        "micro_batch_size": config.train.micro_batch_size,
        "advantage_estimator": config.algo.advantage,
        "kl_loss_type": config.algo.kl_type,
        "kl_coef": 0.0,
        "eps_clip": config.algo.eps_clip,  # slime's reward KL: rlbench accepts 0 only
        "eps_clip_high": config.algo.eps_clip_high,
        "eps_clip_c": config.algo.eps_clip_c,
        "entropy_coef": config.algo.entropy_coef,
        "normalize_advantages": config.algo.normalize_advantages,
        "grpo_std_normalization": config.algo.normalize_std,
        "calculate_per_token_loss": config.algo.per_token_loss,
        "use_tis": config.algo.use_tis,
        "tis_clip": config.algo.tis_clip,
        "tis_clip_low": config.algo.tis_clip_low,
        "max_tokens_per_micro_batch": config.train.max_tokens_per_micro_batch,
        # full recompute of each layer on its own, megatron-core's form of train.recompute
        "recompute_granularity": "full" if config.train.recompute else None,
        "recompute_method": "uniform" if config.train.recompute else None,
        "recompute_num_layers": 1 if config.train.recompute else None,
        "optimizer_cpu_offload": config.train.optimizer_cpu_offload,
        "offload_rollout": config.rollout.offload,
        "offload_train": False,  # not modelled: --offload-train and --colocate are refused by name
        "use_critic": config.algo.advantage == "ppo",
        "value_clip": config.algo.value_clip,
        "gamma": config.algo.gamma,
        "lambd": config.algo.lambd,
        "num_critic_only_steps": config.algo.num_critic_only_steps,
    }


def _slime(case: dict) -> dict:
    slime = dict(case["slime"])
    # The KL loss counts only under --use-kl-loss (slime's policy_loss_function), which rlbench folds into kl_coef.
    coef, use = slime.pop("kl_loss_coef"), slime.pop("use_kl_loss")
    slime["kl_loss_coef_in_loss"] = coef if use else 0.0
    # slime packs micro-batches by --max-tokens-per-gpu only under --use-dynamic-batch-size
    tokens, dynamic = slime.pop("max_tokens_per_gpu"), slime.pop("use_dynamic_batch_size")
    slime["max_tokens_per_micro_batch"] = tokens if dynamic else None
    slime["rollout_stop_token_ids"] = slime["rollout_stop_token_ids"] or []
    for key in ("hf_checkpoint", "num_steps_per_rollout"):  # none in these cases / folded into global_batch_size
        slime.pop(key)
    if slime["use_critic"]:
        # slime turns offload_train on with a critic (arguments.py:1961) so that actor and critic take turns on
        # the GPUs: where weights sleep between stages, not what is computed; rlbench holds both in one process
        slime["offload_train"] = False
    return slime


MODELLED = sorted(name for name, case in EXPECTED["cases"].items() if case["slime"]["kl_coef"] == 0)


def test_slimes_kl_reward_shaping_is_refused_by_name():
    """--kl-coef (KL folded into REINFORCE++ returns) is not modelled: any value but 0 is refused."""
    with pytest.raises(BadInput, match="--kl-coef 0.01: slime's KL reward shaping"):
        _config(EXPECTED["cases"]["reward_kl"]["argv"])
    assert "reward_kl" not in MODELLED and len(MODELLED) == len(EXPECTED["cases"]) - 1


@pytest.mark.parametrize("name", MODELLED)
def test_each_setting_is_slimes(name):
    case = EXPECTED["cases"][name]
    config = _config(case["argv"])
    ours = {**_slime_view(config), "kl_loss_coef_in_loss": config.algo.kl_coef}
    if "role_lr" in case["slime"]:  # --megatron-config-path: each role's learning rate, as slime's roles hold it
        ours["role_lr"] = {"actor": config.train.lr, "critic": config.train.critic_lr}
    theirs = _slime(case)
    assert sorted(ours) == sorted(theirs)
    differ = {key: (ours[key], theirs[key]) for key in theirs if ours[key] != theirs[key]}
    assert differ == {}, f"{name}: rlbench vs slime {EXPECTED['slime_commit'][:12]}"


def test_the_cases_cover_every_mapped_argument():
    given = {arg.split("=")[0] for case in EXPECTED["cases"].values() for arg in case["argv"] if arg.startswith("--")}
    untested = sorted(
        set(slime_args.ARGS)
        - given
        - {
            "--hf-checkpoint",
            "--save",
            "--save-interval",
            "--rm-type",
            "--custom-rm-path",
            "--custom-generate-function-path",
            "--tensor-model-parallel-size",
            "--group-rm",  # plugin settings, which slime's rollout reads (tests/cpu/test_slime_run.py)
            "--sglang-server-concurrency",
            # train_async.py's interval and the delta weight sync: passed through by name and value (choices
            # slime's parser holds), valid only with --async or --rollout sglang, which a slime command line does
            # not say (tests/cpu/test_async.py, tests/cpu/test_weight_delta.py)
            "--update-weights-interval",
            "--update-weight-mode",
            "--update-weight-disk-dir",
            "--update-weight-local-checkpoint-dir",
            "--update-weight-delta-encoding",
            "--update-weight-delta-checksum",
        }
        # where the metrics also go, never what a run computes (tests/cpu/test_metric_loggers.py)
        - set(slime_args.TRACKING)
    )
    assert untested == []


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--colocate"], "no such option: --colocate"),
        (["--offload-train"], "no such option: --offload-train"),
        (["--recompute-granularity", "selective"], "rlbench recomputes whole layers only (full)"),
        (["--recompute-granularity", "full"], "needs --recompute-method and --recompute-num-layers"),
        (["--recompute-method", "block"], "rlbench computes --recompute-method uniform only"),
        (["--ref-load", "/x"], "no such option: --ref-load"),
        (["--optimizer", "sgd"], "--optimizer: --optimizer sgd: rlbench computes --optimizer adam only"),
        (["--kl-coef", "0.1", "--kl-loss-coef", "0.1"], "only one of --kl-coef and --kl-loss-coef"),
        (["--rollout-temperature", "0"], "slime requires --rollout-temperature > 0"),
        (["--advantage-estimator", "reinforce_plus_plus"], "needs --normalize-advantages"),
        (["--save-interval", "2"], "--save-interval needs --save"),
        (["--rollout-batch-size", "5"], "--rollout-batch-size is given twice"),
        (["--lr", "fast"], "--lr: expected a number, got 'fast'"),
        (["--use-tis=1"], "--use-tis is a flag: it takes no value"),
        (["--log-passrate"], "no such option: --log-passrate"),
        (["--wandb-group", "g"], "tracking.wandb_group: expected unset without use_wandb"),
    ],
)
def test_what_slime_refuses_or_rlbench_does_not_model_is_refused_by_name(tmp_path, extra, says):
    argv = EXPECTED["cases"]["defaults"]["argv"] + extra
    res = cli("run", "--out", str(tmp_path / "r"), *argv)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr
    assert not (tmp_path / "r").exists()


def test_a_slime_argument_and_an_rlbench_option_for_one_setting_are_refused(tmp_path):
    res = cli("run", "--steps", "3", *EXPECTED["cases"]["defaults"]["argv"])
    assert res.returncode == 2 and "--num-rollout and an rlbench option set the same setting" in res.stderr


def test_without_slime_arguments_rlbench_keeps_its_own_defaults():
    assert load_config().data.prompt_key == "prompt" and load_config().algo.kl_type == "k3"
    with pytest.raises(BadInput, match="needs --rollout-batch-size"):
        slime_args.resolve({"--num-rollout": 3})


def test_slimes_quick_start_grpo_runs_on_the_fixture(tmp_path):
    """slime's quick-start ROLLOUT, GRPO and OPTIMIZER arguments (docs/en/get_started/quick_start.md), with
    the fixture's data, a parity reward (slime's deepscaler is not rlbench's) and this machine's sizes."""
    from rlbench.config_sections import FIXTURES

    argv = EXPECTED["cases"]["quick_start_grpo"]["argv"]
    argv = [str(FIXTURES / "data" / "parity.jsonl") if a == "data.jsonl" else a for a in argv]
    argv[argv.index("--num-rollout") + 1] = "2"
    printed = cli("run", *argv, "--rm-type", "parity", "--print-config", "--json")
    assert printed.returncode == 0, printed.stderr
    shown = json.loads(printed.stdout)
    assert shown["config"]["algo"]["eps_clip_high"] == 0.28 and shown["config"]["train"]["betas"] == [0.9, 0.98]
    assert {row["argument"]: row["sets"] for row in shown["slime"]}["--global-batch-size"] == {"train.minibatches": 1}
    res = cli("run", *argv, "--rm-type", "parity", "--out", str(tmp_path / "q"), "--json")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert manifest["config"]["data"]["prompt_key"] == "prompt" and manifest["config"]["steps"] == 2
    assert shlex.split(manifest["command"])[1:3] == ["run", "--prompt-data"]
