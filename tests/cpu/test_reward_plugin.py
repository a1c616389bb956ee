"""Contract of reward plugins loaded by dotted path (`--custom-rm-path`), and of the built-ins."""

from __future__ import annotations

import json

import pytest

from rlbench.core.reward import BUILTIN, RewardInput, load_reward_fn, score
from rlbench.errors import BadInput


def _sample(response: str, label: str = "odd") -> RewardInput:
    return RewardInput(({"role": "user", "content": "Is 3 even or odd?"},), response, label, "stop")


@pytest.mark.parametrize("path", ["tests.cpu.plugins.rewards.constant_half", "tests.cpu.plugins.rewards:constant_half"])
def test_loads_by_dotted_path(path):
    name, fn = load_reward_fn("parity", path)
    assert name == path and score(name, fn, _sample("x")) == 0.5


@pytest.mark.parametrize(
    "path, message",
    [
        ("nosuchmodule.fn", "cannot import module 'nosuchmodule'"),
        ("tests.cpu.plugins.rewards.missing", "has no attribute 'missing'"),
        ("tests.cpu.plugins.rewards.NOT_CALLABLE", "is not callable"),
        ("justaname", "expected a dotted path"),
    ],
)
def test_bad_paths_are_refused_clearly(path, message):
    with pytest.raises(BadInput, match=message) as info:
        load_reward_fn("parity", path)
    assert info.value.field == "--custom-rm-path"


@pytest.mark.parametrize(
    "fn_name, message",
    [
        ("returns_nan", "expected a finite number"),
        ("returns_text", "expected a finite number"),
        ("raises", ": reward function raised KeyError: 'label'"),
    ],
)
def test_contract_violations_name_the_function(fn_name, message):
    path = f"tests.cpu.plugins.rewards.{fn_name}"
    name, fn = load_reward_fn("parity", path)
    with pytest.raises(BadInput, match=message) as info:
        score(name, fn, _sample("odd"))
    assert path in str(info.value)


def test_unknown_builtin_is_refused():
    with pytest.raises(BadInput, match="unknown verifier 'nope'"):
        load_reward_fn("nope", None)


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtins_keep_the_contract(name):
    fn = BUILTIN[name]
    for response in ["", "odd", "even", "  odd\n", "It is odd.", "seven", "\x00"]:
        value = score(name, fn, _sample(response))
        assert value in (0.0, 1.0)


def test_parity_takes_the_first_answer():
    assert BUILTIN["parity"](_sample("odd even")) == 1.0
    assert BUILTIN["parity"](_sample("even odd")) == 0.0
    assert BUILTIN["parity"](_sample("ODD")) == 1.0
    assert BUILTIN["parity"](_sample("no answer")) == 0.0
    assert BUILTIN["parity"](_sample("The number is Odd, not even.")) == 1.0
    assert BUILTIN["parity"](_sample("odd", label="ODD")) == 1.0  # the label's case does not matter either
    assert BUILTIN["parity"](_sample("even", label="even")) == 1.0


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("odd", "odd", 1.0),
        ("  odd\n", "odd", 1.0),  # whitespace around the response is not part of the answer
        ("odd", " odd \t", 1.0),  # nor around the label
        ("\n\nseven ", "seven", 1.0),
        ("Odd", "odd", 0.0),  # exact: case counts
        ("odd.", "odd", 0.0),
        ("o dd", "odd", 0.0),
        ("even", "odd", 0.0),
        ("", "odd", 0.0),
        ("", "", 1.0),
    ],
)
def test_exact_match(response, label, expected):
    assert BUILTIN["exact_match"](_sample(response, label)) == expected


def test_the_builtin_is_looked_up_by_name_and_a_custom_path_wins():
    assert load_reward_fn("exact_match", None) == ("exact_match", BUILTIN["exact_match"])
    assert load_reward_fn("parity", None) == ("parity", BUILTIN["parity"])
    with pytest.raises(BadInput) as info:
        load_reward_fn("nope", None)
    assert info.value.field == "reward.verifier"
    assert (
        str(info.value) == "reward.verifier: unknown verifier 'nope' (built-in: parity, exact_match; or give "
        "--custom-rm-path)"
    )
    name, fn = load_reward_fn("exact_match", "tests.cpu.plugins.rewards.constant_half")
    assert name == "tests.cpu.plugins.rewards.constant_half" and fn(_sample("x")) == 0.5


@pytest.mark.parametrize(
    "value, expected",
    [
        (1, 1.0),
        (0, 0.0),
        (-2.5, -2.5),
        (3.4028234663852886e38, 3.4028234663852886e38),
        (-3.4028234663852886e38, -3.4028234663852886e38),
    ],
)
def test_score_takes_finite_numbers_within_float32_as_floats(value, expected):
    got = score("f", lambda sample: value, _sample("x"))
    assert got == expected and type(got) is float


@pytest.mark.parametrize(
    "value", [True, False, None, "1.0", float("inf"), float("-inf"), float("nan"), 3.5e38, -3.5e38, [1.0]]
)
def test_score_refuses_anything_else_naming_the_function(value):
    with pytest.raises(BadInput, match="expected a finite number") as info:
        score("my.reward", lambda sample: value, _sample("x"))
    assert info.value.field == "my.reward" and repr(value) in str(info.value)


def test_custom_reward_drives_the_loop(run_small, tmp_path):
    """A constant reward reaches the recording, and GRPO turns it into zero advantages."""
    from safetensors.torch import load_file

    result = run_small("c", steps=1, reward__custom_rm_path="tests.cpu.plugins.rewards.constant_half")
    assert result.history[0]["rollout/raw_reward"] == 0.5
    tensors = load_file(str(tmp_path / "c" / "rollouts" / "000000.safetensors"))
    assert tensors["rewards"].eq(0.5).all() and tensors["advantages"].eq(0).all()
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["reward_fn"] == "tests.cpu.plugins.rewards.constant_half"
