"""Issue 52: the warm-started fixture policy (rlbench/fixtures/warm_start.py) is what its builder writes, bit for bit,
and it knows the task's format but not the parity: every prompt answered "N even" or "N odd", either word about
half the time, whatever the number."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch

from rlbench.config import RunConfig
from rlbench.core.model import build_model, load_tokenizer
from tests.conftest import REPO

FIXTURE = REPO / "rlbench" / "fixtures" / "models" / "tiny-qwen3-sft"
DATA = REPO / "rlbench" / "fixtures" / "data" / "parity.jsonl"


@pytest.mark.slow
def test_the_builder_writes_the_committed_weights_byte_for_byte(tmp_path):
    """A rebuild (its own process, as the docstring's command runs it) writes the committed files' bytes: the build is
    deterministic and the committed weights are its output, not an edited copy."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "rlbench" / "fixtures" / "warm_start.py"), "--out", str(tmp_path / "sft")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("model.safetensors", "config.json", "build.json"):
        assert (tmp_path / "sft" / name).read_bytes() == (FIXTURE / name).read_bytes(), name


def test_the_default_run_starts_from_the_warm_started_fixture():
    model = RunConfig().model
    assert (model.path, model.init) == (str(FIXTURE), "checkpoint")
    record = json.loads((FIXTURE / "build.json").read_text())
    assert record["built_by"] == "python rlbench/fixtures/warm_start.py" and record["from"]["init"] == "random"


def _word_probabilities():
    """Per prompt of the task: its number, its label, and the fixture's probability of each answer word after the
    answer's own start (the number restated), and its probability of restating the number first."""
    tokenizer = load_tokenizer(REPO / "rlbench" / "fixtures" / "tokenizers" / "qwen-tiny")
    model = build_model(FIXTURE, 0, init="checkpoint").eval()
    words = {w: tokenizer.encode(f" {w}", add_special_tokens=False) for w in ("even", "odd")}
    assert all(len(ids) == 1 for ids in words.values())
    rows = []
    for row in map(json.loads, DATA.read_text().splitlines()):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        start = tokenizer.encode(str(row["n"]), add_special_tokens=False)
        ids = torch.tensor([list(prompt) + start])
        with torch.no_grad():
            logprobs = model(ids).logits[0].log_softmax(-1)
        restated = sum(logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(start))
        last = logprobs[-1].exp()
        rows.append((row["n"], row["label"], {w: last[ids[0]].item() for w, ids in words.items()}, restated))
    return rows


def test_the_fixture_answers_in_the_format_with_either_word_whatever_the_number():
    rows = _word_probabilities()
    assert len(rows) == 200
    # the format: the number restated (likely), then one of the two words
    assert statistics.fmean(r[3] for r in rows) > -0.1
    assert min(p["even"] + p["odd"] for _, _, p, _ in rows) > 0.98
    # either word: no prompt's "even" far from half
    assert all(0.3 < p["even"] < 0.7 for _, _, p, _ in rows), [round(p["even"], 3) for _, _, p, _ in rows]
    # not the parity: the expected correctness is a coin's, and "even" is not likelier on the even numbers
    correct = statistics.fmean(p[label] for _, label, p, _ in rows)
    assert 0.4 < correct < 0.6, correct
    on_even = statistics.fmean(p["even"] for n, _, p, _ in rows if n % 2 == 0)
    on_odd = statistics.fmean(p["even"] for n, _, p, _ in rows if n % 2 == 1)
    assert abs(on_even - on_odd) < 0.05, (on_even, on_odd)
