"""The reasoning probe of `check tito --audit` (tito_reasoning.py) on chat templates written from published ones'
logic (tests/cpu/data/chat_templates/): reasoning a model samples inline in its content (a think block before the
answer), which a template strips from the history, is mode 4 as reasoning_content is, in the shape that names the
form ("reasoning-inline"); a template that passes a think block through as any text reads no reasoning, and the probe
is skipped."""

from __future__ import annotations

import json
from pathlib import Path

from rlbench.checks import tito_reasoning
from rlbench.checks.tito_audit import audit, audit_shape
from rlbench.checks.tito_builders import PlainBuilder
from rlbench.checks.tito_shapes import conversation_shapes, inline_reasoning
from rlbench.core.model import load_tokenizer
from tests.conftest import REPO, run_cli

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"
CLEAN = REPO / "rlbench" / "fixtures" / "tokenizers" / "tito-clean"
# DeepSeek-R1's markers, special or not as its tokenizer has them
R1 = {"<｜begin▁of▁sentence｜>": True, "<｜end▁of▁sentence｜>": True, "<｜User｜>": False, "<｜Assistant｜>": False}


def _tokenizer(tmp_path, template: str, added: dict[str, bool] | None = None, bos=None, eos="<|im_end|>") -> Path:
    """tito-clean's vocabulary with the chat template `template` (a file of TEMPLATES), the `added` tokens (text:
    special) after its own, and its bos and eos tokens."""
    tokenizer = json.loads((CLEAN / "tokenizer.json").read_text())
    first = max(t["id"] for t in tokenizer["added_tokens"]) + 1
    for i, (text, special) in enumerate((added or {}).items()):
        token = {"content": text, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        tokenizer["added_tokens"].append({"id": first + i, **token, "special": special})
    config = json.loads((CLEAN / "tokenizer_config.json").read_text())
    config.update(chat_template=(TEMPLATES / template).read_text(), bos_token=bos, eos_token=eos)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def _deepseek_r1(tmp_path) -> Path:
    return _tokenizer(
        tmp_path, "deepseek_r1_style.jinja", R1, bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>"
    )


def _found(report):
    return [(f.shape, f.mode, f.strict, f.where) for f in report.findings]


def test_the_inline_form_carries_each_turns_reasoning_in_its_content():
    messages = conversation_shapes()["reasoning"][0]
    inline = inline_reasoning(messages)
    assert inline == [
        {"role": "user", "content": "Is 7 even or odd?"},
        {"role": "assistant", "content": "<think>\n7 ends in 7\n</think>\n\nodd"},
        {"role": "user", "content": "And 12?"},
        {"role": "assistant", "content": "<think>\n12 ends in 2\n</think>\n\neven"},
    ]
    assert [tito_reasoning.reasoning_of(m) for m in inline] == [tito_reasoning.reasoning_of(m) for m in messages]
    assert [tito_reasoning.reasoning_of(m) for m in inline] == ["", "7 ends in 7", "", "12 ends in 2"]
    assert messages[1] == {"role": "assistant", "content": "odd", "reasoning_content": "7 ends in 7"}  # not altered


def test_deepseek_r1_strips_inline_reasoning_from_every_turn_mode_4(tmp_path):
    """DeepSeek-R1 renders an assistant turn after its last </think> only, the last turn too, and renders no
    reasoning_content: only the inline form is played. The generation prompt opens the think block the model samples
    its reasoning in; every re-rendering drops it, and each place is a finding (not a hazard: the turn reasoned)."""
    report = audit(_deepseek_r1(tmp_path), ["reasoning"])
    assert (report.shapes, report.skipped) == (["reasoning-inline"], {})
    assert _found(report) == [
        ("reasoning-inline", "reasoning", True, "generation prompt vs turn 1"),
        ("reasoning-inline", "reasoning", True, "generation prompt vs turn 3"),
        ("reasoning-inline", "reasoning", True, "re-render before turn 3"),
        ("reasoning-inline", "reasoning", True, "final re-render"),
    ]
    opened, _, history, last = report.findings
    assert (opened.got_text, opened.expected_text) == ("<think>\n", "\n\nodd<｜end▁of▁sentence｜>")
    assert history.got_text.startswith("<think>\n7 ") and last.got_text.startswith("<think>\n12")


def test_qwq_strips_inline_reasoning_from_every_turn_mode_4(tmp_path):
    """QwQ: the same strip (leading newlines dropped too) under ChatML, whose newline after <|im_end|> the plain
    builder loses (mode 2, found in every multi-turn shape)."""
    report = audit(_tokenizer(tmp_path, "qwq_style.jinja"), ["reasoning"])
    assert (report.shapes, report.skipped) == (["reasoning-inline"], {})
    assert _found(report) == [
        ("reasoning-inline", "reasoning", True, "generation prompt vs turn 1"),
        ("reasoning-inline", "reasoning", True, "generation prompt vs turn 3"),
        ("reasoning-inline", "reasoning", True, "re-render before turn 3"),
        ("reasoning-inline", "separator", True, "re-render before turn 3"),
        ("reasoning-inline", "reasoning", True, "final re-render"),
    ]


def test_qwen3_reads_both_forms_and_strips_each_before_the_last_user_message(tmp_path):
    """Qwen3 keeps the reasoning of the turns after the last user message, from reasoning_content or from the
    content's think block, and strips it from the turns before: both forms are played, each mode 4 where the first
    turn's reasoning leaves the history."""
    tokenizer = _tokenizer(tmp_path, "qwen3_style.jinja")
    report = audit(tokenizer, ["reasoning"])
    assert (report.shapes, report.skipped) == (["reasoning", "reasoning-inline"], {})
    assert _found(report) == [
        ("reasoning", "reasoning", True, "prefix after turn 1"),
        ("reasoning-inline", "reasoning", True, "prefix after turn 1"),
    ]
    assert all(f.got_text.startswith("<think>\n7 ") for f in report.findings)


def test_chatml_with_a_default_system_prompt_reads_no_reasoning_in_either_form(tmp_path):
    """Qwen2.5's plain ChatML, "You are a helpful assistant." inserted: reasoning_content rendered nowhere, a think
    block in the content rendered unchanged in every position. Neither form drops anything: the probe is skipped,
    and no shape reports mode 4. Played all the same, the inline form keeps every turn's think block as sampled."""
    tokenizer = _tokenizer(tmp_path, "chatml_default_system.jinja")
    report = audit(tokenizer)
    assert report.skipped == {"reasoning": tito_reasoning.NOT_REASONING}
    assert report.shapes == [s for s in conversation_shapes() if s != "reasoning"]
    assert "reasoning" not in report.modes and set(report.modes) == {"separator", "truncated"}
    tok = load_tokenizer(tokenizer)
    messages = conversation_shapes()["reasoning"][0]
    assert not tito_reasoning.renders_reasoning(PlainBuilder(tok, {}), messages, None)
    assert not tito_reasoning.changes_inline_reasoning(PlainBuilder(tok, {}), inline_reasoning(messages), None)
    played = audit_shape(tok, "reasoning-inline", inline_reasoning(messages), None)
    assert played and {f.mode for f in played} == {"separator"}


def test_the_cli_reports_deepseek_r1s_inline_strip_as_mode_4(tmp_path):
    """Through `rlbench check tito --audit`: exit 1, as the reasoning_content case (tito-reasoning), each finding of
    the inline form mode 4 and strict, in the table and in --json."""
    tokenizer = str(_deepseek_r1(tmp_path))
    text = run_cli("check", "tito", "--tokenizer", tokenizer, "--audit")
    assert text.returncode == 1 and "Traceback" not in text.stderr, text.stderr
    assert "shape: reasoning-inline" in text.stdout and "mode: 4 reasoning\n" in text.stdout, text.stdout
    doc = run_cli("check", "tito", "--tokenizer", tokenizer, "--audit", "--json")
    assert doc.returncode == 1
    inline = [f for f in json.loads(doc.stdout)["findings"] if f["shape"] == "reasoning-inline"]
    assert len(inline) == 4 and all((f["mode"], f["number"], f["strict"]) == ("reasoning", 4, True) for f in inline)


def test_an_inline_turn_is_sampled_as_its_content_reads():
    """Where the template dropped the think block, the model sampled the content whole, then what the rendering
    closes the turn with; after a prompt that opened the block, the rest of it. Anything but whitespace before the
    answer, and the reasoning has no place: lost."""
    message = {"role": "assistant", "content": "<think>\n7 ends in 7\n</think>\n\nodd"}
    assert tito_reasoning.with_reasoning("\n\nodd<e>", message, "<A>") == (
        "<think>\n7 ends in 7\n</think>\n\nodd<e>",
        False,
    )
    assert tito_reasoning.with_reasoning("odd<e>\n", message, "<A><think>\n") == (
        "7 ends in 7\n</think>\n\nodd<e>\n",
        False,
    )
    assert tito_reasoning.with_reasoning("odd<e>", message, "<A><think>") == (
        "\n7 ends in 7\n</think>\n\nodd<e>",
        False,
    )
    assert tito_reasoning.with_reasoning("[odd]<e>", message, "<A>") == ("[odd]<e>", True)
    kept = "<think>\n7 ends in 7\n</think>\n\nodd<e>"
    assert tito_reasoning.with_reasoning(kept, message, "<A>") == (kept, False)  # rendered as sampled
    assert tito_reasoning.with_reasoning("odd<e>", {**message, "reasoning_content": "7"}, "<A>") == ("odd<e>", True)
