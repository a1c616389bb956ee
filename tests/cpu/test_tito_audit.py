"""`check tito --audit`: each fixture tokenizer flags its own drift mode and only that one; the
clean one passes; every finding's index is where the ids really part."""

from __future__ import annotations

import json

import pytest

from rlbench.checks.tito import SHAPES, audit
from tests.conftest import REPO, run_cli

TOKENIZERS = REPO / "fixtures" / "tokenizers"
OWN_MODE = {"tito-reencode": "reencode", "tito-separator": "separator", "tito-reasoning": "reasoning",
            "tito-position": "position", "tito-special": "special", "tito-truncated": "truncated"}


def test_clean_template_passes_every_shape():
    report = audit(TOKENIZERS / "tito-clean")
    assert report.shapes == list(SHAPES) and report.findings == []


@pytest.mark.parametrize("name", sorted(OWN_MODE))
def test_each_fixture_flags_its_own_mode_only(name):
    report = audit(TOKENIZERS / name)
    assert set(report.modes) == {OWN_MODE[name]}, report.modes
    assert report.strict


@pytest.mark.parametrize("name", sorted(OWN_MODE))
def test_finding_index_is_where_the_ids_part(name):
    for f in audit(TOKENIZERS / name).findings:
        if f.where.startswith("decode"):  # the special-token finding compares text, not two id lists
            continue
        k = f.index - max(0, f.index - 3)  # position of the index inside the windows
        assert f.expected[:k] == f.got[:k]
        assert f.expected[k:k + 1] != f.got[k:k + 1]


def test_qwen_style_template_drifts_as_qwen_does():
    """The default fixture renders <|im_end|>\\n after every message, like Qwen2.5/Qwen3 (trl 5317),
    and cannot mark a truncated turn."""
    assert set(audit(TOKENIZERS / "qwen-tiny").modes) == {"separator", "truncated"}


def test_cli_audit_exit_codes():
    clean = run_cli("check", "tito", "--tokenizer", str(TOKENIZERS / "tito-clean"), "--audit", "--json")
    assert clean.returncode == 0, clean.stderr
    assert json.loads(clean.stdout)["findings"] == []
    drift = run_cli("check", "tito", "--tokenizer", str(TOKENIZERS / "tito-reasoning"), "--audit")
    assert drift.returncode == 1 and "reasoning" in drift.stdout
