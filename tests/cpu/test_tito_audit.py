"""`check tito --audit`: each fixture tokenizer flags its own drift mode and only that one; the
clean one passes; every finding's index is where the ids really part."""

from __future__ import annotations

import json

import pytest

from rlbench.checks import tito_audit
from rlbench.checks.tito_audit import audit, conversation_shapes
from tests.conftest import REPO, run_cli

TOKENIZERS = REPO / "fixtures" / "tokenizers"
OWN_MODE = {"tito-reencode": "reencode", "tito-separator": "separator", "tito-reasoning": "reasoning",
            "tito-position": "position", "tito-special": "special", "tito-truncated": "truncated"}


def test_clean_template_passes_every_shape():
    report = audit(TOKENIZERS / "tito-clean")
    assert report.shapes == list(conversation_shapes()) and report.findings == []


@pytest.mark.parametrize("name", sorted(OWN_MODE))
def test_each_fixture_flags_its_own_mode_only(name):
    report = audit(TOKENIZERS / name)
    assert set(report.modes) == {OWN_MODE[name]}, report.modes
    assert report.strict


@pytest.mark.parametrize("name", sorted(OWN_MODE))
def test_finding_index_is_where_the_ids_part(name, monkeypatch):
    """Each finding shows the ids from its index on, on both sides, and they part right there; its
    context is the ids just before the index. Checked against the builder's own sequences."""
    from rlbench.checks import tito
    from rlbench.core.model import load_tokenizer

    tok = load_tokenizer(TOKENIZERS / name)
    seen = []
    original = tito.finding

    def spy(tok_, shape, where, got, expected, index, *args, **kwargs):
        found = original(tok_, shape, where, got, expected, index, *args, **kwargs)
        seen.append((found, list(got), list(expected)))
        return found

    monkeypatch.setattr(tito, "finding", spy)  # through tito.divergence
    monkeypatch.setattr(tito_audit, "finding", spy)  # the audit's own calls
    report = audit(TOKENIZERS / name)
    assert report.findings and len(seen) == len(report.findings)
    for found, got, expected in seen:
        i = found.index
        assert got[:i] == expected[:i], "the sequences agree before the index"
        assert got[i:i + 1] != expected[i:i + 1], "and part at it"
        assert found.got == got[i:i + 4] and found.expected == expected[i:i + 4]
        assert found.context == got[max(0, i - 3):i]
        assert found.got_text == tito.decode(tok, found.got) and found.expected_text == tito.decode(tok, found.expected)


def test_the_expected_and_got_texts_show_the_difference_not_a_prefix_before_it():
    report = audit(TOKENIZERS / "tito-separator", ["multi-turn"])
    [f] = report.findings
    assert f.expected_text.startswith("\n") and not f.got_text.startswith("\n"), (f.expected_text, f.got_text)


def test_a_template_that_raises_on_one_shape_is_that_shapes_finding():
    """tito-function reads tool_call.function (Llama 3.x style) and refuses parallel calls from inside the
    template: that shape is a 'template error' finding, every other shape is still audited and passes."""
    report = audit(TOKENIZERS / "tito-function")
    assert report.shapes == list(conversation_shapes())
    [f] = report.findings
    assert (f.shape, f.mode, f.strict) == ("consecutive-tool-results", "template", True)
    assert f.where == "template error: This model only supports single tool-calls at once!"
    res = run_cli("check", "tito", "--tokenizer", str(TOKENIZERS / "tito-function"), "--audit")
    assert res.returncode == 1 and "Traceback" not in res.stderr and "template error" in res.stdout


def test_bare_tool_calls_are_read_by_a_template_that_takes_both_shapes_only():
    """The bare {"name", "arguments"} shape, which the audit used to send: tito-clean reads both shapes;
    tito-function, like Llama 3.x, cannot, and says so as a finding instead of a traceback."""
    bare = [{"role": "user", "content": "Is 3 plus 4 even or odd?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": "3+4"}]},
            {"role": "tool", "content": "7"}, {"role": "assistant", "content": "odd"}]
    from rlbench.core.model import load_tokenizer

    assert tito_audit.audit_shape(load_tokenizer(TOKENIZERS / "tito-clean"), "bare", bare, None) == []
    [f] = tito_audit.audit_shape(load_tokenizer(TOKENIZERS / "tito-function"), "bare", bare, None)
    assert f.mode == "template" and "has no attribute 'function'" in f.where


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


def test_the_special_finding_points_at_the_dropped_special_token():
    """tito-special marks <tool_call> and </tool_call> special: a decode that skips them drops the first one
    sampled, and the finding's index is that token, the text on both sides from there."""
    findings = [f for f in audit(TOKENIZERS / "tito-special").findings if f.mode == "special"]
    assert findings and {f.shape for f in findings} >= {"tool-result", "tool-result-with-tools"}
    for f in findings:
        assert (f.number, f.strict, f.expected[0]) == (8, True, 316), f
        assert f.expected_text.startswith("<tool_call>") and not f.got_text.startswith("<tool_call>")
        assert f.where.startswith("decode of turn ")
