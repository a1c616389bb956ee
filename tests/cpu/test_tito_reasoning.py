"""The reasoning probe of `check tito --audit` (tito_reasoning.py) on chat templates written from published ones'
logic (tests/cpu/data/chat_templates/): reasoning a model samples inline in its content (a think block before the
answer), which a template strips from the history, is mode 4 as reasoning_content is, in the shape that names the
form ("reasoning-inline"); a template that passes a think block through as any text reads no reasoning, and the probe
is skipped. Then the probe's parts, each as a property: a turn's reasoning, the turn as sampled, the think block it
compares, which turns it reads, and what it asks the builder to render."""

from __future__ import annotations

import json
from pathlib import Path

from rlbench.checks import tito_reasoning, tito_shapes
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


def _builder(template: str, **kwargs) -> PlainBuilder:
    """The plain builder over tito-clean's vocabulary with the chat template `template` (its text) and kwargs."""
    tok = load_tokenizer(CLEAN)
    tok.chat_template = template
    return PlainBuilder(tok, kwargs)


def _template(name: str, *edits: tuple[str, str]) -> str:
    """The template `name` of TEMPLATES with each (old, new) edit made, each where it occurs once."""
    text = (TEMPLATES / name).read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


_REASONING = conversation_shapes()["reasoning"][0]
_INLINE = inline_reasoning(_REASONING)
# Qwen3's test for the turns whose reasoning it renders (after the last user message), and what it renders before
_QWEN3_KEEPS = "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
_QWEN3_STRIPPED = "{{- '<|im_start|>assistant\\n' + content -}}"
# QwQ's assistant turn (after the content's last </think>) and its generation prompt, which opens the think block
_QWQ_TURN = "{{- '<|im_start|>assistant\\n' + message['content']"
_QWQ_PROMPT = "{{- '<|im_start|>assistant\\n<think>\\n' -}}"


def test_a_turns_reasoning_is_its_reasoning_content_else_the_think_block_in_its_content():
    """reasoning_content is a turn's reasoning, even beside a think block in its content; without it, the think block,
    the content's own or one the generation prompt opened (the content starts inside it); a turn with no text content
    (tool calls only) has none."""
    both = {"role": "assistant", "content": "<think>\nplan\n</think>\n\nodd", "reasoning_content": "7 ends in 7"}
    assert tito_reasoning.reasoning_of(both) == "7 ends in 7"
    assert (
        tito_reasoning.reasoning_of({"role": "assistant", "content": "7 ends in 7\n</think>\n\nodd"}) == "7 ends in 7"
    )
    calls = {"role": "assistant", "content": None, "tool_calls": [tito_shapes.calculator_call("3+4")]}
    assert tito_reasoning.reasoning_of(calls) == ""


def test_reasoning_the_template_left_out_goes_in_the_empty_think_block_it_rendered():
    """A turn rendered with an empty think block (the reasoning dropped, its place kept, as GLM-4.5 renders the
    history) was sampled with the reasoning in it, laid out as the block is: on lines of its own where the block has
    whitespace, bare where it has none. Not lost."""
    message = {"role": "assistant", "content": "odd", "reasoning_content": "7 ends in 7"}
    assert tito_reasoning.with_reasoning("<think>\n\n</think>\n\nodd<e>", message, "<A>") == (
        "<think>\n7 ends in 7\n</think>\n\nodd<e>",
        False,
    )
    assert tito_reasoning.with_reasoning("<think></think>odd<e>", message, "<A>") == (
        "<think>7 ends in 7</think>odd<e>",
        False,
    )


def test_a_turn_that_closes_the_block_its_prompt_opened_was_sampled_with_its_reasoning_before_the_close():
    """A generation prompt that opens a think block (whitespace after the tag or not) and a turn rendered from the
    </think> that closes it (whitespace before or not): the model sampled its reasoning before that close. A turn
    that closes a block no prompt opened gives the reasoning no place: lost."""
    message = {"role": "assistant", "content": "odd", "reasoning_content": "7 ends in 7"}
    assert tito_reasoning.with_reasoning("\n</think>\n\nodd<e>", message, "<A><think>\n") == (
        "7 ends in 7\n</think>\n\nodd<e>",
        False,
    )
    assert tito_reasoning.with_reasoning("</think>odd<e>", message, "<A><think>") == (
        "7 ends in 7</think>odd<e>",
        False,
    )
    assert tito_reasoning.with_reasoning("</think>odd<e>", message, "<A>") == ("</think>odd<e>", True)


def test_an_inline_turn_is_sampled_up_to_its_answer_as_the_template_splits_it():
    """The answer is what follows the content's last </think>, as the templates split it (words and all), found
    where the rendering begins even where the rest of the turn repeats it (a tool call's arguments); the sampled
    content runs to that answer's end whatever the reasoning says. Where the prompt opened the block, the content's
    own <think> (after any leading whitespace) is not sampled again, nor the prompt's whitespace after it where the
    content has that whitespace."""
    sampled = tito_reasoning.with_reasoning
    tagged = {"role": "assistant", "content": "<think>\n7 ends in 7\n</think>\n\nI close with </think>, so: it is odd"}
    assert sampled(", so: it is odd<e>", tagged, "<A>") == (tagged["content"] + "<e>", False)
    called = {"role": "assistant", "content": "<think>\n7 ends in 7\n</think>\n\nodd"}
    assert sampled('odd<call>{"answer": "odd"}</call><e>', called, "<A>") == (
        called["content"] + '<call>{"answer": "odd"}</call><e>',
        False,
    )
    said = {"role": "assistant", "content": "<think>\nodd, as 7 ends in 7\n</think>\n\nodd"}
    assert sampled("odd<e>", said, "<A>") == (said["content"] + "<e>", False)
    spaced = {"role": "assistant", "content": "\n<think>\n7 ends in 7\n</think>\n\nodd"}
    assert sampled("odd<e>", spaced, "<A><think>\n") == ("7 ends in 7\n</think>\n\nodd<e>", False)
    tight = {"role": "assistant", "content": "<think>7 ends in 7</think>odd"}
    assert sampled("odd<e>", tight, "<A><think>\n") == ("7 ends in 7</think>odd<e>", False)


def test_the_think_block_of_a_reasoning_is_the_one_around_its_last_occurrence():
    """A reasoning's think block in a rendering: from the <think> that opens it (not one of a block closed before it,
    nor a later one) to the </think> after it, markers included; the reasoning on where no opened block holds it; to
    the reasoning's end where nothing closes it; None where it is absent."""
    block = tito_reasoning._think_block
    text = (
        "<s>Reason in <think> </think> tags.</s><u>Is 7 odd, as 7 ends in 7?</u>"
        "<a><think>\n7 ends in 7\n</think>\n\nodd</a><u>12?</u><a><think>\n12 ends in 2\n</think>\n\neven</a>"
    )
    assert block(text, "7 ends in 7") == "<think>\n7 ends in 7\n</think>"
    assert block(text, "12 ends in 2") == "<think>\n12 ends in 2\n</think>"
    assert block("<think>\n7 ends in 7\n</think>odd", "7 ends in 7") == "<think>\n7 ends in 7\n</think>"
    assert block("7 ends in 7\n</think>\n\nodd", "7 ends in 7") == "7 ends in 7\n</think>"  # opened before the text
    assert block("<think>\nI end with </think>\n</think>odd", "I end with </think>") == (
        "<think>\nI end with </think>\n</think>"
    )
    assert block("<think>\n\n</think>\n\n7 ends in 7", "7 ends in 7") == "7 ends in 7"
    assert block("<a><think>\n7 ends in 7", "7 ends in 7") == "<think>\n7 ends in 7"
    assert block("<a>odd</a>", "7 ends in 7") is None


def test_only_assistant_turns_that_reasoned_tell_whether_a_template_reads_reasoning():
    """Each assistant turn that carries reasoning is probed, rendered as the last turn and in the whole conversation;
    a turn without reasoning (or with blank reasoning_content), or a user's message carrying some (another model
    playing the user), tells nothing. Qwen3 keeps the one reasoning turn's reasoning where it was sampled, the last
    turn, and strips it from the history, in both forms; plain ChatML reads it in neither."""
    messages = [
        {"role": "user", "content": "Is 7 even or odd?", "reasoning_content": "a question on parity"},
        {"role": "assistant", "content": "odd", "reasoning_content": "7 ends in 7"},
        {"role": "user", "content": "And 12?"},
        {"role": "assistant", "content": "even", "reasoning_content": "\n"},
    ]
    for template, reads in (("qwen3_style.jinja", True), ("chatml_default_system.jinja", False)):
        builder = _builder(_template(template))
        assert tito_reasoning.renders_reasoning(builder, messages, None) is reads, template
        assert tito_reasoning.changes_inline_reasoning(builder, inline_reasoning(messages), None) is reads, template


def test_qwen3_without_thinking_still_renders_a_turns_reasoning_as_the_last_turn():
    """enable_thinking=False: the generation prompt closes an empty think block, which the turn, rendered with its
    reasoning, does not start with; the turn as a whole holds the reasoning: a reasoning template."""
    messages = [*_REASONING[:3], {"role": "assistant", "content": "even"}]
    assert tito_reasoning.renders_reasoning(
        _builder(_template("qwen3_style.jinja"), enable_thinking=False), messages, None
    )


def test_a_template_that_shows_the_think_tags_outside_the_turn_reads_no_reasoning():
    """A default system prompt that shows the think tags (an empty block) is not the turn's: only the turn's
    rendering after its prompt can hold its reasoning, and plain ChatML with that prompt reads none."""
    template = _template(
        "chatml_default_system.jinja", ("You are a helpful assistant.", "Reason in <think> </think> tags, then answer.")
    )
    assert not tito_reasoning.renders_reasoning(_builder(template), _REASONING, None)


def test_a_turn_closing_a_think_block_holds_reasoning_only_where_its_prompt_opened_the_block():
    """QwQ's generation prompt opens a think block; a template that renders each turn with that block closed empty
    (the reasoning dropped) reads reasoning: the model samples it there. One whose turns close a block that no
    generation prompt opened reads none."""
    closed = _template("qwq_style.jinja", (_QWQ_TURN, _QWQ_TURN.replace("\\n'", "\\n<think>\\n</think>\\n\\n'")))
    assert tito_reasoning.renders_reasoning(_builder(closed), _REASONING, None)
    stray = _template(
        "qwq_style.jinja",
        (_QWQ_TURN, _QWQ_TURN.replace("\\n'", "\\n</think>\\n\\n'")),
        (_QWQ_PROMPT, "{{- '<|im_start|>assistant\\n' -}}"),
    )
    assert not tito_reasoning.renders_reasoning(_builder(stray), _REASONING, None)


def test_a_template_that_renders_reasoning_in_the_history_only_reads_reasoning():
    """Reasoning rendered in some position makes a reasoning template, the history included: here each turn's
    reasoning once the conversation goes on past it, never as the last turn."""
    history_only = _template("qwen3_style.jinja", (_QWEN3_KEEPS, "{%- if not loop.last and reasoning -%}"))
    assert tito_reasoning.renders_reasoning(_builder(history_only), _REASONING, None)


def test_a_template_that_lays_out_the_historys_think_block_otherwise_changes_inline_reasoning():
    """Not only a dropped think block: Qwen3 keeping the history's reasoning but in a block of another layout (no
    newlines) changes the block the model sampled as the last turn, and the inline form is played."""
    relaid = _template(
        "qwen3_style.jinja",
        (
            _QWEN3_STRIPPED,
            "{{- '<|im_start|>assistant\\n' + ('<think>' + reasoning.strip('\\n') + '</think>' if reasoning else '')"
            " + content -}}",
        ),
    )
    assert tito_reasoning.changes_inline_reasoning(_builder(relaid), _INLINE, None)


def test_a_template_that_cannot_render_reasoning_is_probed_in_each_form_so_that_its_error_is_found():
    """A template that raises on a turn's reasoning, in either form: both forms are played (and each reports the
    error as its finding), none is skipped as 'not a reasoning template'."""
    raising = _template(
        "qwen3_style.jinja",
        (_QWEN3_KEEPS, "{%- if reasoning -%}{{- raise_exception('no reasoning here') -}}{%- endif -%}" + _QWEN3_KEEPS),
    )
    forms = tito_reasoning.reasoning_forms(_builder(raising), "reasoning", _REASONING, None)
    assert forms == [("reasoning", _REASONING), ("reasoning-inline", _INLINE)]


class _Recorder:
    """A builder that records what each rendering is asked for: (messages, tools, generation prompt)."""

    def __init__(self, builder):
        self.builder, self.calls = builder, []

    def render(self, messages, tools, generation):
        self.calls.append((len(messages), tools, generation))
        return self.builder.render(messages, tools, generation)


def test_the_probe_renders_with_the_shapes_tools_and_a_generation_prompt_only_before_a_turn():
    """Every rendering the probe asks for carries the shape's tools; only a turn's prompt has a generation prompt,
    not the turn rendered as the last one, nor the whole conversation. Plain ChatML reads no reasoning, so every
    turn is asked for: for reasoning_content the whole, then each turn's prompt and the turn; inline, the whole, then
    each turn."""
    recorder, tools = _Recorder(_builder(_template("chatml_default_system.jinja"))), [tito_shapes.CALCULATOR]
    assert tito_reasoning.reasoning_forms(recorder, "reasoning", _REASONING, tools) == []
    steps = [(4, False), (1, True), (2, False), (3, True), (4, False)] + [(4, False), (2, False), (4, False)]
    assert recorder.calls == [(n, tools, generation) for n, generation in steps]


def test_a_block_is_reasoning_when_a_turns_reasoning_stands_on_one_side_only():
    """reasoning_block, the part classify never sees: a block that holds a turn's reasoning whole on one side only, or
    a part of it (three characters or more, think markers aside) against nothing, is mode 4, on either side; the same
    text on both sides, a part too short to tell, a part against other text, or text of no turn's reasoning is not.
    An empty reasoning text (a turn without reasoning) is passed over, not the end of the search."""
    from rlbench.checks.tito import encode, reasoning_block

    tok = load_tokenizer(CLEAN)
    thought = ("7 ends in 7, odd",)

    def block(a: str, b: str, reasoning=thought) -> bool:
        return reasoning_block(tok, encode(tok, a), encode(tok, b), reasoning)

    assert block("<think>7 ends in 7, odd</think>", "") and block("", "<think>7 ends in 7, odd</think>")
    assert not block("<think>7 ends in 7, odd</think>", "<think>7 ends in 7, odd</think>")
    for part in ("<think>7 ends", "in 7, odd</think>", "<think>end</think>", "7 e"):  # a part, whatever markers
        assert block(part, "") and block("", part), part
        assert block(part, "  \n") and block("\n", part), part  # whitespace is nothing
    assert not block("7 ", "") and not block("", " 7")  # a part of two characters tells nothing
    assert not block("<think>7 ends", "odd") and not block("odd", "in 7, odd</think>")  # against other text
    assert not block("<think>12 ends", "") and not block("", "12 ends</think>")  # no turn's reasoning
    assert block("<think>7 ends", "", ("", "7 ends in 7, odd"))  # a turn without reasoning first
    assert not block("<think>7 ends", "", ())
