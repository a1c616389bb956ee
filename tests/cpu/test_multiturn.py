"""The multi-turn calculator task: the token-in-token-out builder gives trajectories `check tito`
finds clean; the naive builder drifts, and each finding sits where the ids really part and names
the real cause. Plus the generate-function contract and the calculator tool."""

from __future__ import annotations

import json

import pytest

from rlbench.checks.tito_run import check_run
from rlbench.config import load_config
from rlbench.core.generate import check_trajectory, load_generate_fn
from rlbench.session import run
from rlbench.core.model import load_tokenizer
from rlbench.errors import BadInput
from rlbench.rundir.recording import read_step
from rlbench.tasks.calculator import calculator
from tests.conftest import REPO, run_cli

TOK = load_tokenizer(REPO / "rlbench" / "fixtures" / "tokenizers" / "tito-clean")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mt")
    for name in ("multiturn", "multiturn-naive"):
        run(load_config(REPO / "configs" / f"{name}.toml", steps=2, out=str(root / name)))
    return root


def _samples(root):  # (tokens, loss mask, metadata) of every sample of both steps
    for step in (0, 1):
        tensors, meta = read_step(root, step)
        for i, sample in enumerate(meta["samples"]):
            a, b = int(tensors["offsets"][i]), int(tensors["offsets"][i + 1])
            yield tensors["tokens"][a:b].tolist(), tensors["loss_mask"][a:b].tolist(), sample


def _naive_first_divergence(a, b):
    for i in range(min(len(a), len(b))):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_tito_builder_has_no_drift(runs):
    assert check_run(runs / "multiturn").findings == []
    for tokens, mask, sample in _samples(runs / "multiturn"):
        first, second = sample["turns"]
        assert (
            second["prompt_ids"][: len(first["prompt_ids"]) + len(first["output_ids"])]
            == first["prompt_ids"] + first["output_ids"]
        )
        # The loss mask is 1 exactly on the ids the engine sampled, 0 on prompt and tool/user tokens.
        sampled = set(range(len(first["prompt_ids"]), len(first["prompt_ids"]) + len(first["output_ids"])))
        sampled |= set(range(len(second["prompt_ids"]), len(tokens)))
        assert [i for i, m in enumerate(mask) if m] == sorted(sampled)
        assert tokens == second["prompt_ids"] + second["output_ids"]


def test_naive_builder_drift_is_found_where_it_is_and_classified(runs):
    report = check_run(runs / "multiturn-naive")
    assert report.strict and report.findings
    by_sample = {(f.step, f.sample): f for f in report.findings}
    checked = 0
    for step in (0, 1):
        tensors, meta = read_step(runs / "multiturn-naive", step)
        for sample in meta["samples"]:
            i = sample["index"]
            trained = tensors["tokens"][int(tensors["offsets"][i]) : int(tensors["offsets"][i + 1])].tolist()
            first, second = sample["turns"]
            # The oracle, in the rule's order: turn 0 against turn 1's prompt, turn 1 against the trained ids.
            expected = None
            for turn, (nxt, where) in enumerate(
                [(second["prompt_ids"], "turn 0 vs turn 1's prompt"), (trained, "turn 1 vs the trained ids")]
            ):
                got = sample["turns"][turn]["prompt_ids"] + sample["turns"][turn]["output_ids"]
                index = _naive_first_divergence(got, nxt[: len(got)])
                if index is not None:
                    expected = (where, index, got, sample["turns"][turn]["output_ids"])
                    break
            if expected is None:  # decode-then-encode happened to be exact for this sample
                assert (step, i) not in by_sample
                continue
            where, index, got, out = expected
            finding = by_sample[(step, i)]
            assert (finding.where, finding.finding.index) == (where, index)
            if finding.finding.mode == "special":  # the sampled id there is one decode drops
                assert TOK.decode([got[index]], skip_special_tokens=True) == ""
            else:
                assert finding.finding.mode == "reencode"  # decode then encode is not the identity
                assert TOK.encode(TOK.decode(out, skip_special_tokens=True), add_special_tokens=False) != out
            checked += 1
    assert checked > 0 and set(report.rates) <= {"reencode", "special"}


def test_cli_check_tito_on_runs(runs):
    clean = run_cli("check", "tito", str(runs / "multiturn"), "--json")
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["findings"] == []
    drift = run_cli("check", "tito", str(runs / "multiturn-naive"), "--json")
    assert drift.returncode == 1
    assert json.loads(drift.stdout)["rates"]


def test_jsonl_of_trajectories(tmp_path):
    messages = [{"role": "user", "content": "Is 3 even or odd?"}, {"role": "assistant", "content": "odd"}]
    ids = TOK.apply_chat_template(messages, tokenize=True)["input_ids"]
    broken = list(ids)
    broken[12] = (broken[12] + 1) % 300
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"messages": messages, "token_ids": list(ids)})
        + "\n"
        + json.dumps({"messages": messages, "token_ids": broken})
        + "\n"
    )
    report = check_run(path, REPO / "rlbench" / "fixtures" / "tokenizers" / "tito-clean")
    assert report.samples == 2 and [f.sample for f in report.findings] == [2]
    assert report.findings[0].finding.index == 12


@pytest.mark.parametrize(
    "path, message",
    [("nosuch.module.fn", "cannot import module"), ("rlbench.tasks.calculator.missing", "has no attribute")],
)
def test_generate_loader_refuses_bad_paths(path, message):
    with pytest.raises(BadInput, match=message):
        load_generate_fn(path)


@pytest.mark.parametrize(
    "fn, message",
    [("wrong_lengths", "must have one length"), ("not_a_trajectory", "expected rlbench.core.generate.Trajectory")],
)
def test_generate_contract_violations_stop_the_run(tmp_path, fn, message):
    config = load_config(
        REPO / "configs" / "multiturn.toml",
        steps=1,
        out=str(tmp_path / "r"),
        rollout__custom_generate_function_path=f"tests.cpu.plugins.generate.{fn}",
    )
    with pytest.raises(BadInput, match=message) as info:
        run(config)
    assert f"tests.cpu.plugins.generate.{fn}" in str(info.value)


def test_check_trajectory_rejects_bad_masks_and_reasons():
    from rlbench.core.generate import Trajectory

    with pytest.raises(BadInput, match="other than 0 and 1"):
        check_trajectory(Trajectory([1], [2], [0.0], "stop", "", []), "f")
    with pytest.raises(BadInput, match="finish_reason"):
        check_trajectory(Trajectory([1], [1], [0.0], "done", "", []), "f")


ERROR = "error: expected integers joined by + - *"


@pytest.mark.parametrize(
    "expr, result",
    [
        ("3+4", "7"),
        ("2*-3", "-6"),
        (" 10 - 4 * 2 ", "2"),
        ("-7", "-7"),
        ("999999*999999", "999998000001"),
        ("1000000", ERROR),
        ("__import__('os')", ERROR),
        ("1+", ERROR),
        ("10**9", ERROR),
        ("(1).real", ERROR),
        ("7/2", ERROR),
        ("7.0", ERROR),
        ("+7", ERROR),
        ("True+1", ERROR),
        ("-" * 5000 + "1", ERROR),
    ],
)
def test_calculator_evaluates_only_arithmetic(expr, result):
    """The tool's exact output: what the model reads back is the integer as Python writes it, or the error."""
    assert calculator(expr) == result


def test_a_multiturn_run_replays_and_diffs_bit_for_bit(runs, tmp_path):
    """A generate function's trajectories carry their own prompt ids (the chat with its tools), and the `data`
    checksum is taken of those, as recorded: the run's recording verifies, and replay reproduces it (it parted at
    step 0, stage data, when the checksum was of the dataset's ids)."""
    from rlbench.replay.diff import diff
    from rlbench.replay.replay import replay

    for name in ("multiturn", "multiturn-naive"):
        res = replay(runs / name, tmp_path / name)
        assert res.ok and res.reproduced == 2 and "data" in res.compared_stages
        assert diff(runs / name, tmp_path / name).first is None
