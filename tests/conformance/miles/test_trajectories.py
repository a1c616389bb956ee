"""Miles' mock trajectories (miles_tito_tokenizers.testing.mock_trajectories) through `check tito JSONL`, on real
chat templates: rows a TITO builder made pass, and say they trained on what was sampled; rows a naive pipeline made
(the template's re-render) are never called "no drift"; rows whose turns a pipeline decoded with
skip_special_tokens=True and encoded again are mode 8. Trajectories a template cannot render are that row's finding,
never an internal error."""

from __future__ import annotations

import json

import pytest

from rlbench.checks.tito_run import check_run
from tests.conformance.miles.common import (
    FIXED,
    ORIGINAL,
    TOKENIZERS,
    naive,
    play,
    stops,
    tokenizer,
    trajectory_classes,
)
from tests.conftest import run_cli


def _tito(name: str, family: str, roles, kwargs=None):
    from miles_tito_tokenizers import get_tito_tokenizer

    return get_tito_tokenizer(tokenizer(name), family, chat_template_kwargs=kwargs, allowed_append_roles=roles)


def _rows(name: str, kind: str, source: str | None = None) -> list[dict]:
    """Rows of every mock trajectory the family's builder may append and whose turns extend their generation prompt
    (the others: an empty think block, the audit's business), built on `source`'s template (default: `name`)."""
    family, roles = FIXED[name]
    source = source or name
    tok, stop = tokenizer(source), stops(source)
    tito = _tito(source, family, roles, ORIGINAL[source][1] if source in ORIGINAL and source != name else None)
    rows = []
    for cls in trajectory_classes(set(roles)):
        try:
            row = naive(tok, tito, cls, stop) if kind == "naive" else play(tok, tito, cls, stop, kind == "skip")
        except AssertionError:  # a turn that does not begin with its generation prompt
            continue
        rows.append(row)
    assert len(rows) >= 5, (name, kind, len(rows))
    return rows


def _jsonl(tmp_path, rows, drop=()) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in drop}) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("name", sorted(FIXED))
def test_tito_built_rows_pass_and_say_they_trained_on_what_was_sampled(tmp_path, name):
    report = check_run(_jsonl(tmp_path, _rows(name, "tito")), TOKENIZERS / name)
    assert report.findings == [] and report.sampled_rows == report.samples >= 5


def test_the_cli_headlines_say_what_was_compared(tmp_path):
    rows, name = _rows("qwen3-fixed", "tito"), str(TOKENIZERS / "qwen3-fixed")
    tito = run_cli("check", "tito", _jsonl(tmp_path, rows), "--tokenizer", name)
    assert tito.returncode == 0 and "trained on what was sampled" in tito.stdout, tito.stdout
    naive_rows = run_cli(
        "check", "tito", _jsonl(tmp_path, _rows("qwen3-fixed", "naive"), drop=("sampled",)), "--tokenizer", name
    )
    assert naive_rows.returncode == 0, naive_rows.stderr
    assert "equal to the chat template's re-render" in naive_rows.stdout and "no drift" not in naive_rows.stdout
    assert "a naive pipeline's ids are this re-render by construction" in naive_rows.stdout


@pytest.mark.parametrize("name", ["qwen3", "kimi25", "minimax-m25"])
def test_naive_rows_of_an_original_template_did_not_train_on_what_was_sampled(tmp_path, name):
    """The re-render of an original template drops reasoning the engine sampled (Kimi K2.5's even from the last
    turn): held to their sampled ids, the naive rows are drift, mode 4."""
    fixed = ORIGINAL[name][0]
    report = check_run(_jsonl(tmp_path, _rows(fixed, "naive", source=name)), TOKENIZERS / name)
    lost = [f.finding for f in report.findings if f.finding.strict]
    assert lost and all("sampled vs trained" in f.where for f in lost)
    assert {f.sample for f in report.findings if f.finding.mode == "reasoning"} == {f.sample for f in report.findings}
    # the same trajectories as a TITO builder trained them: what the re-render changes is a hazard only
    tito = check_run(_jsonl(tmp_path, _rows(fixed, "tito", source=name)), TOKENIZERS / name)
    assert not tito.strict and {f.finding.mode for f in tito.findings} <= {"reasoning"}


@pytest.mark.parametrize("name", ["qwen3-fixed", "glm47", "kimi25-fixed", "minimax-m25-fixed"])
def test_skip_special_rows_are_mode_8(tmp_path, name):
    rows = _rows(name, "skip")
    report = check_run(_jsonl(tmp_path, rows), TOKENIZERS / name)
    assert report.strict and {f.finding.mode for f in report.findings} == {"special"}
    assert {f.sample for f in report.findings} == set(range(1, len(rows) + 1))  # every row
    # without the sampled ids, against the re-render alone: still mode 8, and only that; except GLM-4.7, whose
    # skipped specials are the stops that open the next turn, which its builder renders back: the sampled stop is
    # lost all the same, which only the sampled ids show
    bare = check_run(_jsonl(tmp_path, rows, drop=("sampled",)), TOKENIZERS / name)
    assert {f.finding.mode for f in bare.findings} == (set() if name == "glm47" else {"special"})
    assert all(f.finding.category in ("special_token_count", "special_token_type") for f in bare.findings)


def test_a_row_the_template_cannot_render_is_that_rows_finding(tmp_path):
    """Qwen3.5 refuses a system message after the first one; GLM-4.7 reads tool-call arguments as a mapping and
    cannot take OpenAI-style JSON strings. Each such row is a template finding; the command exits 1, not 3."""
    from miles_tito_tokenizers.testing import RetrySystemTrajectory, SingleToolTrajectory

    system = {"messages": RetrySystemTrajectory.MESSAGES, "tools": RetrySystemTrajectory.TOOLS, "token_ids": [1, 2]}
    res = run_cli(
        "check", "tito", _jsonl(tmp_path, [system]), "--tokenizer", str(TOKENIZERS / "qwen35-fixed"), "--json"
    )
    assert res.returncode == 1, res.stderr
    [f] = json.loads(res.stdout)["findings"]
    assert (f["finding"]["mode"], f["where"]) == (
        "template",
        "template error: System message must be at the beginning.",
    )
    messages = json.loads(json.dumps(SingleToolTrajectory.MESSAGES))
    for call in messages[2]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    strings = {"messages": messages, "tools": SingleToolTrajectory.TOOLS, "token_ids": [1, 2]}
    res = run_cli("check", "tito", _jsonl(tmp_path, [strings]), "--tokenizer", str(TOKENIZERS / "glm47"), "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["findings"][0]["finding"]["mode"] == "template", res.stdout
