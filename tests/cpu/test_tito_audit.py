"""`check tito --audit`: each fixture tokenizer flags its own drift mode and only that one, in the shapes and at
the stage where it shows, every place it shows; the clean one passes; what only a naive pipeline breaks is a hazard,
which fails the audit only when asked; every finding's index is where the ids really part; the builder renders what a
sampler would see and samples up to the first end-of-turn."""

from __future__ import annotations

import json

import pytest

from rlbench.checks import tito_audit, tito_reasoning, tito_shapes
from rlbench.checks.tito_audit import audit, audit_shape
from rlbench.checks.tito_shapes import conversation_shapes
from rlbench.core.model import load_tokenizer
from tests.conftest import REPO, run_cli

TOKENIZERS = REPO / "rlbench" / "fixtures" / "tokenizers"
OWN_MODE = {
    "tito-reencode": "reencode",
    "tito-separator": "separator",
    "tito-reasoning": "reasoning",
    "tito-position": "position",
    "tito-special": "special",
    "tito-truncated": "truncated",
}
HAZARDS = {"reencode", "special", "truncated"}  # what only a re-rendering or decoding pipeline breaks


def test_clean_template_passes_every_shape():
    report = audit(TOKENIZERS / "tito-clean")
    assert report.shapes == list(conversation_shapes()) and report.findings == []


def _all_but(*left_out):
    return [s for s in conversation_shapes() if s not in left_out]


# fixture: where its drift is found (the stage of the builder), and in which shapes
# (every turn that re-encodes is its own divergence: two in the two-answer shapes)
FOUND = {
    "tito-reencode": (
        "final re-render",
        [
            "single-turn",
            "multi-turn",
            "multi-turn",
            "tool-result",
            "consecutive-tool-results",
            "truncated",
            "multi-turn-with-tools",
            "multi-turn-with-tools",
            "tool-result-with-tools",
        ],
    ),
    "tito-separator": ("final re-render", _all_but("single-turn", "truncated")),
    "tito-reasoning": ("prefix after turn 1", ["reasoning"]),
    "tito-position": ("prefix after turn 1", _all_but("single-turn")),
    "tito-special": ("decode of turn 1", ["tool-result", "consecutive-tool-results", "tool-result-with-tools"]),
    "tito-truncated": ("final re-render", ["truncated"]),
}


def test_the_conversation_shapes_are_the_documented_ones():
    """What the audit plays, message by message; tool calls in the shape Hugging Face documents (type "function",
    the arguments a dict)."""

    def line(message):
        rest = dict(message)
        text = f"{rest.pop('role')}: {rest.pop('content')}"
        for call in rest.pop("tool_calls", []):
            assert set(call) == {"type", "function"} and call["type"] == "function", call
            assert set(call["function"]) == {"name", "arguments"} and isinstance(call["function"]["arguments"], dict)
            text += f" -> {call['function']['name']}({json.dumps(call['function']['arguments'])})"
        return text + "".join(f" [{key}: {value}]" for key, value in sorted(rest.items()))

    parity, call = (
        ["user: Is 7 even or odd?", "assistant: odd", "user: And 12?", "assistant: even"],
        [
            "user: Is 3 plus 4 even or odd?",
            'assistant:  -> calculator({"expression": "3+4"})',
            "tool: 7",
            "assistant: odd",
        ],
    )
    tools = [tito_shapes.CALCULATOR]
    shapes = conversation_shapes()
    assert {name: ([line(m) for m in messages], t) for name, (messages, t) in shapes.items()} == {
        "single-turn": (parity[:2], None),
        "multi-turn": (parity, None),
        "tool-result": (call, None),
        "consecutive-tool-results": (
            [
                "user: Is 3 plus 4 even, and 6?",
                'assistant:  -> calculator({"expression": "3+4"}) -> calculator({"expression": "6"})',
                "tool: 7",
                "tool: 6",
                "assistant: odd even",
            ],
            None,
        ),
        "reasoning": (
            [
                "user: Is 7 even or odd?",
                "assistant: odd [reasoning_content: 7 ends in 7]",
                "user: And 12?",
                "assistant: even [reasoning_content: 12 ends in 2]",
            ],
            None,
        ),
        "truncated": (
            ["user: Is 7 even or odd?", "assistant: The answer [truncated: True]", "user: Go on.", "assistant: odd"],
            None,
        ),
        "multi-turn-with-tools": (parity, tools),
        "tool-result-with-tools": (call, tools),
    }
    assert list(shapes) == [
        "single-turn",
        "multi-turn",
        "tool-result",
        "consecutive-tool-results",
        "reasoning",
        "truncated",
        "multi-turn-with-tools",
        "tool-result-with-tools",
    ]


@pytest.mark.parametrize("name", sorted(OWN_MODE))
def test_each_fixture_flags_its_own_mode_only(name):
    report = audit(TOKENIZERS / name)
    assert set(report.modes) == {OWN_MODE[name]}, report.modes
    hazard = OWN_MODE[name] in HAZARDS
    assert report.strict is not hazard and all(f.strict is not hazard for f in report.findings)
    assert report.hazards == (report.findings if hazard else [])
    assert audit(TOKENIZERS / name, strict=True).strict  # --strict: hazards fail the audit too
    where, shapes = FOUND[name]
    assert [(f.shape, f.mode, f.where) for f in report.findings] == [(s, OWN_MODE[name], where) for s in shapes]
    assert report.tokenizer == str(TOKENIZERS / name)


@pytest.mark.parametrize("name", sorted(OWN_MODE))
def test_finding_index_is_where_the_ids_part(name, monkeypatch):
    """Each finding shows the ids from its index on, on both sides, and they part right there; its
    context is the ids just before the index. Checked against the builder's own sequences."""
    from rlbench.checks import tito
    from rlbench.core.model import load_tokenizer

    tok = load_tokenizer(TOKENIZERS / name)
    seen = []
    original = tito._shown  # every finding is made there: classified (tito.finding) or not (block_findings)

    def spy(tok_, shape, where, got, expected, index, *args, **kwargs):
        found = original(tok_, shape, where, got, expected, index, *args, **kwargs)
        seen.append((found, list(got), list(expected)))
        return found

    monkeypatch.setattr(tito, "_shown", spy)
    report = audit(TOKENIZERS / name)
    assert report.findings and len(seen) == len(report.findings)
    for found, got, expected in seen:
        i = found.index
        assert got[:i] == expected[:i], "the sequences agree before the index"
        assert got[i : i + 1] != expected[i : i + 1], "and part at it"
        assert found.got == got[i : i + 4] and found.expected == expected[i : i + 4]
        assert found.context == got[max(0, i - 3) : i]
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
    bare = [
        {"role": "user", "content": "Is 3 plus 4 even or odd?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": "3+4"}]},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "odd"},
    ]
    from rlbench.core.model import load_tokenizer

    assert tito_audit.audit_shape(load_tokenizer(TOKENIZERS / "tito-clean"), "bare", bare, None) == []
    [f] = tito_audit.audit_shape(load_tokenizer(TOKENIZERS / "tito-function"), "bare", bare, None)
    assert f.mode == "template" and "has no attribute 'function'" in f.where


def test_qwen_style_template_drifts_as_qwen_does():
    """The default fixture renders <|im_end|>\\n after every message, like Qwen2.5/Qwen3 (trl 5317), and
    cannot mark a truncated turn. It renders no reasoning at all: not a reasoning template, so the reasoning probe
    does not apply to it (no mode 4)."""
    report = audit(TOKENIZERS / "qwen-tiny")
    assert set(report.modes) == {"separator", "truncated"}
    assert report.skipped == {"reasoning": tito_audit.NOT_REASONING} and "reasoning" not in report.shapes


# Plain ChatML with a default system prompt (Qwen2.5's shape), made from tito-clean's template: one renders no
# reasoning anywhere, the other keeps the last turn's reasoning and strips it from the history.
_CLEAN_REASONING = (
    "{%- if message.get('reasoning_content') %}{{- '<think>\\n' + message['reasoning_content'] + "
    "'\\n</think>\\n\\n' }}{%- endif %}"
)
_DEFAULT_SYSTEM = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful "
    "assistant.<|im_end|>' }}{%- endif %}"
)


def _chatml_with_default_system(tmp_path, reasoning: str):
    """tito-clean's tokenizer with a default system prompt and `reasoning` in place of its reasoning block."""
    config = json.loads((TOKENIZERS / "tito-clean" / "tokenizer_config.json").read_text())
    template = config["chat_template"]
    assert template.count(_CLEAN_REASONING) == 1 and template.count("{%- if not loop.first or tools %}") == 1
    template = template.replace(_CLEAN_REASONING, reasoning).replace(
        "{%- if not loop.first or tools %}", "{%- if not loop.first or tools or messages[0]['role'] != 'system' %}"
    )
    config["chat_template"] = _DEFAULT_SYSTEM + template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((TOKENIZERS / "tito-clean" / "tokenizer.json").read_bytes())
    return tmp_path


def test_a_template_that_renders_no_reasoning_anywhere_is_not_probed(tmp_path):
    """Plain ChatML with a default system prompt: the reasoning_content the probe adds is rendered in no position,
    and the same reasoning inline in the content is rendered unchanged in every position,
    so the reasoning shape is not audited ("not a reasoning template: probe skipped", in text and --json) and the
    audit passes over the other shapes, saying how many."""
    tokenizer = _chatml_with_default_system(tmp_path, "")
    report = audit(tokenizer)
    assert report.findings == [] and report.skipped == {"reasoning": tito_audit.NOT_REASONING}
    assert report.shapes == _all_but("reasoning")
    doc = run_cli("check", "tito", "--tokenizer", str(tokenizer), "--audit", "--json")
    assert doc.returncode == 0, doc.stderr
    assert json.loads(doc.stdout)["skipped"]["reasoning"].startswith("not a reasoning template: probe skipped")
    text = run_cli("check", "tito", "--tokenizer", str(tokenizer), "--audit")
    assert text.returncode == 0 and "7 shapes intact" in " ".join(text.stdout.split()), text.stdout
    assert "note: shape reasoning not audited: not a reasoning template: probe skipped" in text.stderr


def test_a_template_that_strips_reasoning_from_the_history_is_still_mode_4(tmp_path):
    """The same ChatML, rendering a turn's reasoning only after the last user message: a reasoning template, probed;
    the first turn's reasoning, sampled, is gone from the history."""
    kept_last = _CLEAN_REASONING.replace(
        "message.get('reasoning_content') %}", "message.get('reasoning_content') and loop.index0 > ns.last_user %}"
    )
    tokenizer = _chatml_with_default_system(tmp_path, kept_last)
    report = audit(tokenizer)
    assert report.skipped == {} and report.shapes == list(conversation_shapes())
    assert [(f.shape, f.mode, f.strict, f.where) for f in report.findings] == [
        ("reasoning", "reasoning", True, "prefix after turn 1")
    ]
    res = run_cli("check", "tito", "--tokenizer", str(tokenizer), "--audit", "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["modes"] == {"reasoning": 1}, res.stdout


def test_a_reasoning_template_that_loses_a_turns_reasoning_even_last_is_mode_4():
    """The probe asks whether the template renders reasoning somewhere; where it does, a turn whose reasoning has no
    place even as the last turn is still lost (here: the template renders the second turn's reasoning only)."""
    tok = load_tokenizer(TOKENIZERS / "tito-clean")
    tok.chat_template = tok.chat_template.replace(
        "message.get('reasoning_content') %}", "message.get('reasoning_content') and loop.index0 > 1 %}"
    )
    messages = conversation_shapes()["reasoning"][0]
    assert tito_reasoning.renders_reasoning(tito_audit.PlainBuilder(tok, {}), messages, None)
    lost = [f for f in audit_shape(tok, "reasoning", messages, None) if f.where.startswith("turn ")]
    assert [(f.mode, f.where) for f in lost] == [
        ("reasoning", "turn 1: its reasoning is not in the template's rendering of the turn, even as the last turn")
    ]


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
        assert (f.number, f.strict, f.expected[0]) == (8, False, 316), f  # a hazard: only a naive decode drops it
        assert f.expected_text.startswith("<tool_call>") and not f.got_text.startswith("<tool_call>")
        assert f.where.startswith("decode of turn ")


_user, _assistant = tito_shapes.user_message, tito_shapes.assistant_message


def _generation_prompt_followed_by(tok, text):
    """tito-clean's template with `text` (template-escaped) after its generation prompt's opening line."""
    end = "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    assert tok.chat_template.count(end) == 1
    tok.chat_template = tok.chat_template.replace(end, end.replace("\\n'", "\\n" + text + "'"))
    return tok


def test_the_builder_renders_each_step_with_the_shapes_tools(monkeypatch):
    """The generation prompt, then per turn: its prompt, the turn, the grown history, and the builder's two
    renderings (the history, the grown conversation with its generation prompt); then the whole conversation.
    Each rendering with the shape's tools and kwargs, and a generation prompt only where a sampler would get one.
    (First, the audit's probe of the assistant header: a one-message conversation, no tools.)"""
    from rlbench.checks import tito_builders

    calls, render = [], tito_builders.render

    def spy(tok, messages, tools, generation, kwargs=None):
        calls.append((len(messages), tools, generation, kwargs))
        return render(tok, messages, tools, generation, kwargs)

    monkeypatch.setattr(tito_builders, "render", spy)
    audit(TOKENIZERS / "tito-clean", ["tool-result-with-tools", "multi-turn"], kwargs={"enable_thinking": False})
    steps = [(1, True), (1, True), (2, False), (3, True), (2, False), (3, True), (3, True), (4, False), (4, False)]
    tools, kw = [tito_shapes.CALCULATOR], {"enable_thinking": False}
    assert calls == [(1, None, True, kw), (1, None, False, kw)] + [(n, tools, g, kw) for n, g in steps] + [
        (n, None, g, kw) for n, g in steps
    ]


def test_three_turns_each_grow_from_the_one_before():
    messages = [_user("7?"), _assistant("odd"), _user("12?"), _assistant("even"), _user("9?"), _assistant("odd")]
    assert audit_shape(load_tokenizer(TOKENIZERS / "tito-clean"), "three", messages, None) == []


def test_a_truncated_last_turn_closed_by_the_rendering_is_no_finding():
    """Nothing was trained after a truncated last turn: the end-of-turn that tito-truncated's template (which
    cannot mark a truncated turn) closes it with is no drift; continued, it is (test_each_fixture_...)."""
    tok = load_tokenizer(TOKENIZERS / "tito-truncated")
    assert audit_shape(tok, "cut", [_user("7?"), _assistant("The answer", truncated=True)], None) == []


def test_a_turn_is_sampled_up_to_its_first_end_of_turn():
    """A sampler stops at the first end-of-turn: what a rendered turn has after it was never sampled."""
    tok = load_tokenizer(TOKENIZERS / "tito-clean")
    [f] = audit_shape(tok, "s", [_user("Is 7 odd?"), _assistant("odd<|im_end|>even")], None)
    assert (f.where, f.expected_text, f.got_text, f.context_text) == (
        "final re-render",
        "even<|im_end|>",
        "",
        "\nodd<|im_end|>",
    )


def test_a_generation_prompt_the_turn_does_not_start_with():
    """Like Qwen3 without thinking: the generation prompt opens an empty think block that the rendered turn has
    not, at every turn, each its own finding, with the prompt's ids as got and the turn's as expected. The turns
    carry no reasoning, so what the rendering drops is an empty think block no message key can carry: a hazard."""
    tok = _generation_prompt_followed_by(load_tokenizer(TOKENIZERS / "tito-clean"), "<think>\\n\\n</think>\\n\\n")
    messages = [_user("Is 7 odd?"), _assistant("odd"), _user("And 12?"), _assistant("even")]
    first, second = audit_shape(tok, "no-think", messages, None)
    for f, j, answer in ((first, 1, "odd"), (second, 3, "even")):
        assert (f.shape, f.where, f.mode, f.strict) == (
            "no-think",
            f"generation prompt vs turn {j}",
            "reasoning",
            False,
        )
        assert (f.context_text, f.got_text, f.expected_text) == (
            "<|im_start|>assistant\n",
            "<think>\n\n</think>",
            f"{answer}<|im_end|>",
        )
    # with reasoning in the turn, what the rendering drops was sampled: a finding
    messages[1] = _assistant("odd", reasoning_content="7 ends in 7")
    assert [f.strict for f in audit_shape(tok, "think", messages, None)][:1] == [True]


def test_where_divergence_finds_nothing_there_is_no_finding(monkeypatch):
    """A tokenizer that normalises text can give two different texts ids that agree but for closing whitespace:
    block_findings() then finds nothing, and the builder must list nothing, at each of its three stages."""
    no_think = _generation_prompt_followed_by(load_tokenizer(TOKENIZERS / "tito-clean"), "\\n")
    messages = conversation_shapes()["multi-turn"][0]
    monkeypatch.setattr(tito_audit, "block_findings", lambda *args, **kwargs: [])
    assert audit_shape(no_think, "s", messages, None) == []  # generation prompt vs turn
    assert audit_shape(load_tokenizer(TOKENIZERS / "tito-position"), "s", messages, None) == []  # prefix
    assert audit_shape(load_tokenizer(TOKENIZERS / "tito-reencode"), "s", messages, None) == []  # final re-render


def test_the_special_finding_is_special_even_where_classify_would_say_otherwise():
    """A dropped special token is the decode's fault whatever it is: here <think>, marked special, which classify
    alone would call reasoning (a think block on one side only)."""
    from tokenizers import AddedToken

    tok = load_tokenizer(TOKENIZERS / "tito-special")
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<think>", special=True)]})
    [f] = audit_shape(tok, "s", [_user("Is 7 odd?"), _assistant("<think>7</think>odd")], None)
    assert (f.mode, f.number, f.where, f.expected_text, f.got_text) == (
        "special",
        8,
        "decode of turn 1",
        "<think>7</think>odd",
        "7</think>odd",
    )


def test_the_special_finding_points_past_text_sampled_before_the_dropped_token():
    tok = load_tokenizer(TOKENIZERS / "tito-special")
    messages = [_user("Is 3 plus 4 odd?"), _assistant("Let me see.", tool_calls=[tito_shapes.calculator_call("3+4")])]
    [f] = audit_shape(tok, "s", messages, None)
    assert f.where == "decode of turn 1" and f.expected[0] == 316 and f.context_text == "ee."
    assert f.got_text.startswith("calc") and f.expected_text.startswith("<tool_call>cal")


def test_a_template_error_is_one_line_finding():
    from jinja2 import TemplateError

    from rlbench.checks.tito import Finding

    f = tito_audit.template_error("s", TemplateError("cannot\n   render  this"))
    assert f == Finding(
        "s",
        "template",
        0,
        True,
        -1,
        [],
        [],
        [],
        "",
        "",
        "TemplateError: cannot render this",
        "template error: cannot render this",
    )
    assert tito_audit.template_error("s", TemplateError("")).where == "template error: TemplateError"


def test_a_tokenizer_without_a_chat_template_is_bad_input(tmp_path):
    from rlbench.errors import BadInput

    config = json.loads((TOKENIZERS / "tito-clean" / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((TOKENIZERS / "tito-clean" / "tokenizer.json").read_bytes())
    with pytest.raises(BadInput) as info:
        audit(tmp_path)
    assert str(info.value) == f"{tmp_path}: the tokenizer has no chat template to audit"


def test_a_tokenizer_without_an_eos_token_is_one_line_and_exit_2(tmp_path):
    config = json.loads((TOKENIZERS / "tito-clean" / "tokenizer_config.json").read_text())
    config["eos_token"] = None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((TOKENIZERS / "tito-clean" / "tokenizer.json").read_bytes())
    res = run_cli("check", "tito", "--tokenizer", str(tmp_path), "--audit")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "expected an eos token" in lines[0], res.stderr
    assert "Traceback" not in res.stdout + res.stderr
