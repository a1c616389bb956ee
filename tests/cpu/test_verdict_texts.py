"""Verdict texts that agree with themselves: every line `check tito` prints is read against its own `--json`.

The case that broke (issue 50): on a `--dump-details` directory with no engine ids, the headline said 21 of 24
samples "cannot be told sampled from re-tokenised" and the next line that they "were sampled ... They trained as
sampled". Here each number a line states is the JSON's, and a line says "sampled" of samples only where the JSON
shows they were (the engine's ids compared, or their log-probs agreeing)."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO, cli


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    """A run that recorded the engine's ids: the sampled lens."""
    out = tmp_path_factory.mktemp("texts") / "run"
    res = cli("run", "--steps", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr
    return out


def _both(*args: str) -> tuple[list[str], dict]:
    text, doc = cli(*args), cli(*args, "--json")
    assert text.returncode == doc.returncode == 0, text.stderr + doc.stderr
    return text.stdout.strip().splitlines(), json.loads(doc.stdout)


def _counts(line: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+) samples", line)]


def _check_against_json(lines: list[str], doc: dict) -> None:
    headline, canonical = lines[0], next(line for line in lines if line.startswith("canonical re-tokenisation:"))
    evidence = doc["evidence"]
    undetermined = evidence.get("undetermined", 0) + evidence.get("no_logprobs", 0)
    assert _counts(canonical) == [(doc["non_canonical"], doc["samples"])], canonical
    if doc["lens"] == "sampled":
        assert not doc["findings"] and f"no drift: the trained ids of all {doc['samples']} samples" in headline
        assert "were sampled as ids" in canonical and "They trained as sampled" in canonical
        return
    # the evidence lens: "sampled" only of those whose log-probs agree; the undetermined said so, with their count
    assert "were sampled as" not in canonical and "They trained as sampled" not in canonical, canonical
    assert f"{evidence.get('sampled', 0)} shown sampled so" in canonical, canonical
    if undetermined:
        assert _counts(headline) == [(undetermined, doc["samples"])], headline
        assert "cannot be told sampled from re-tokenised" in headline and f"{undetermined} undetermined" in canonical
    else:
        assert "no drift found by evidence" in headline and "undetermined" not in canonical


def test_a_dump_directory_without_engine_ids_is_not_said_to_be_sampled():
    lines, doc = _both("check", "tito", str(REPO / "examples" / "slime-dump-details"))
    assert doc["lens"] == "evidence" and doc["evidence"].get("undetermined", 0) > 0  # the case as it was met
    _check_against_json(lines, doc)


def test_a_run_with_engine_ids_says_what_was_compared(sampled_run):
    lines, doc = _both("check", "tito", str(sampled_run))
    assert doc["lens"] == "sampled" and doc["compared"] == doc["samples"] > 0
    _check_against_json(lines, doc)


def test_a_replay_that_parts_says_how_many_steps_reproduced_before(sampled_run, tmp_path):
    """The count in the text is the JSON's `reproduced`: the steps replayed bit for bit before the one that parts."""
    from tests.cpu.recordings import copy_run, edit_step

    run = copy_run(sampled_run, tmp_path / "run")
    edit_step(run, 1, lambda t, m: t["rewards"].__setitem__(0, 0.5))  # another run's rewards at step 1
    text = cli("replay", str(run), "--out", str(tmp_path / "a"))
    doc = cli("replay", str(run), "--out", str(tmp_path / "b"), "--json")
    assert text.returncode == doc.returncode == 1, text.stderr + doc.stderr
    reproduced = json.loads(doc.stdout)["reproduced"]
    assert reproduced == 1 and "at step 1, stage advantages" in text.stdout
    assert "(1 step before it reproduced)" in text.stdout, text.stdout
