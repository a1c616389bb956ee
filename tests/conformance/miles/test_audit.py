"""`check tito --audit` on real chat templates (tokenizers/, build_tokenizers.py) under Miles' builders: the fixed
templates Miles ships, with their family's builder and registered kwargs, keep every shape intact (exit 0); their
originals do not (exit 1) with the drift Miles' own verifier reports, and rlbench says more where Miles is silent
(Kimi K2.5's original drops the reasoning a model sampled; GLM-4.7's and MiniMax's generation prompts open a think
block that a turn without reasoning renders without). No template makes the command exit 3."""

from __future__ import annotations

import json

import pytest

from rlbench.checks.tito_audit import audit
from tests.conformance.miles.common import FIXED, ORIGINAL, TOKENIZERS, tokenizer
from tests.conftest import run_cli


def _audit(name: str, family: str, roles, kwargs=None, strict=False):
    return audit(TOKENIZERS / name, family=family, kwargs=kwargs or {}, roles=roles, strict=strict)


def _miles_passes(name: str, family: str, roles, kwargs) -> bool:
    """Miles' own check of a template under its family's builder: every mock trajectory, merged by the builder,
    decodes to the template's rendering (testing/chat_template_verify.py, thinking on)."""
    from miles_tito_tokenizers.testing import run_all_checks_via_tito

    results = run_all_checks_via_tito(
        tokenizer(name), family, allowed_append_roles=set(roles), thinking="on", extra_template_kwargs=kwargs
    )
    return bool(results) and all(r.passed for r in results)


@pytest.mark.parametrize("name", sorted(FIXED))
def test_a_fixed_template_with_its_family_builder_keeps_every_shape(name):
    family, roles = FIXED[name]
    report = _audit(name, family, roles)
    assert (report.strict, report.shapes, report.skipped) == (False, _shapes(), {}), report.findings
    assert all(f.mode in ("truncated", "reasoning", "special") for f in report.hazards)
    assert report.builder == family and report.roles == roles and report.notes == []
    assert _miles_passes(name, family, roles, {})  # Miles agrees


@pytest.mark.parametrize("name", sorted(ORIGINAL))
def test_an_original_template_fails_where_miles_fails_and_where_rlbench_says_more(name):
    fixed, kwargs = ORIGINAL[name]
    family, roles = FIXED[fixed]
    report = _audit(name, family, roles, kwargs)
    assert report.strict and "reasoning" in {f.mode for f in report.findings if f.strict}, report.findings
    if name == "kimi25":  # Miles' verifier renders the history from the messages: the reasoning it drops is no loss
        assert _miles_passes(name, family, roles, kwargs)
        lost = [f for f in report.findings if f.strict]
        assert {f.shape for f in lost} == {"reasoning"} and {f.category for f in lost} == {"special_token_count"}
    else:
        assert not _miles_passes(name, family, roles, kwargs)


def _shapes():
    from rlbench.checks.tito_shapes import conversation_shapes

    return list(conversation_shapes())


@pytest.mark.parametrize("name", ["glm47", "minimax-m25-fixed"])
def test_the_generation_prompt_opens_a_think_block_a_turn_without_reasoning_renders_without(name):
    """Only rlbench looks: the prompt ends in <think>; a turn that reasoned nothing renders `</think>odd`
    (GLM-4.7) or no think block (MiniMax). A hazard (no message key carries an empty think block), named per turn;
    with --strict it fails the audit."""
    family, roles = FIXED[name]
    report = _audit(name, family, roles)
    opened = [f for f in report.findings if f.where.startswith("generation prompt vs turn")]
    assert opened and all((f.mode, f.strict) == ("reasoning", False) for f in opened)
    assert "<think>" in opened[0].got_text and "<think>" not in opened[0].expected_text
    assert {f.shape for f in opened} >= {"single-turn", "multi-turn", "tool-result"}
    assert "reasoning" not in {f.shape for f in opened}  # turns that reasoned render what they sampled
    assert _audit(name, family, roles, strict=True).strict


def test_a_reasoning_strip_behind_a_separator_is_named():
    """GLM-4.7's own template (clear_thinking left on) under rlbench's plain builder: the plain builder doubles the
    sampled <|user|> stop (mode 3) before the template strips the first turn's reasoning (mode 4); both named."""
    report = audit(TOKENIZERS / "glm47", ["reasoning", "multi-turn"])
    strict = [(f.shape, f.mode) for f in report.findings if f.strict]
    assert ("reasoning", "reasoning") in strict and ("multi-turn", "stop") in strict


def test_the_plain_builder_loses_what_each_family_builder_puts_back():
    """The fixed Qwen3 template under rlbench's plain builder: the newline after <|im_end|> (mode 2), which Miles'
    qwen3 builder re-inserts; GLM-4.7 under it: the sampled stop that also opens the next turn, doubled (mode 3),
    which Miles' glm47 builder trims."""
    qwen = audit(TOKENIZERS / "qwen3-fixed", ["multi-turn", "tool-result"], kwargs={"clear_thinking": False})
    assert {f.mode for f in qwen.findings if f.strict} == {"separator"}
    assert not audit(
        TOKENIZERS / "qwen3-fixed", ["multi-turn", "tool-result"], family="qwen3", roles=["tool", "user"]
    ).findings
    glm = audit(TOKENIZERS / "glm47", ["tool-result"], kwargs={"clear_thinking": False})
    assert "stop" in {f.mode for f in glm.findings if f.strict}


@pytest.mark.parametrize("name,family", [("deepseek-v32", "deepseekv32"), ("deepseek-v4", "deepseekv4")])
def test_deepseek_is_audited_through_its_encoder(name, family):
    """No chat template: Miles' DeepSeek encoder renders. In thinking mode it refuses a final answer without
    reasoning, and V4's builder its own dummy conversation (findings, never an internal error); in chat mode every
    tool shape is intact."""
    thinking = _audit(name, family, None)
    assert thinking.strict and "template" in {f.mode for f in thinking.findings}
    chat = _audit(name, family, None, {"enable_thinking": False})
    assert (chat.strict, chat.findings, sorted(chat.skipped)) == (
        False,
        [],
        ["multi-turn", "multi-turn-with-tools", "reasoning", "truncated"],
    )


def test_kwargs_roles_and_the_family_are_recorded_and_the_cli_exits_by_them():
    base = ["check", "tito", "--audit", "--tokenizer", str(TOKENIZERS / "glm47"), "--tito-model", "glm47", "--json"]
    tool_user = run_cli(*base, "--tito-allowed-append-roles", "tool,user")
    assert tool_user.returncode == 0, tool_user.stderr
    doc = json.loads(tool_user.stdout)
    assert (doc["builder"], doc["roles"], doc["kwargs"], doc["strict"]) == (
        "glm47",
        ["tool", "user"],
        {"clear_thinking": False},
        False,
    )
    assert doc["findings"] and all(f["category"] for f in doc["findings"])
    # the user's kwargs win over the registered ones, in either spelling
    cleared = run_cli(
        *base,
        "--tito-allowed-append-roles",
        "tool",
        "--tito-allowed-append-roles",
        "user",
        "--apply-chat-template-kwargs",
        '{"clear_thinking": true}',
    )
    assert cleared.returncode == 1 and json.loads(cleared.stdout)["kwargs"] == {"clear_thinking": True}
    strict = run_cli(*base, "--tito-allowed-append-roles", "tool,user", "--strict")
    assert strict.returncode == 1
    skipped = run_cli("check", "tito", "--audit", "--tokenizer", str(TOKENIZERS / "glm47"), "--tito-model", "glm47")
    assert skipped.returncode == 0 and "shape multi-turn not audited: it appends user" in skipped.stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tito-model", "llama9"], "unknown TITO model family 'llama9'"),
        (["--tito-model", "qwen3", "--tito-allowed-append-roles", "developer"], "unknown append role(s) developer"),
        (["--tito-model", "kimi25", "--tito-allowed-append-roles", "tool,user,system"], "No SUPPORTED_TEMPLATES row"),
        (["--tito-allowed-append-roles", "tool"], "give --tito-model too"),
        (["--chat-template-kwargs", "[1]"], "expected a JSON object"),
        (["--chat-template-kwargs", "{"], "expected a JSON object"),
    ],
)
def test_bad_builder_options_are_one_line_bad_input(argv, message):
    res = run_cli("check", "tito", "--audit", "--tokenizer", str(TOKENIZERS / "qwen3-fixed"), *argv)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_tokenizer_without_the_familys_markup_is_bad_input():
    res = run_cli("check", "tito", "--audit", "--tokenizer", str(TOKENIZERS / "qwen3-fixed"), "--tito-model", "glm47")
    assert res.returncode == 2 and "cannot serve Miles' glm47 builder" in res.stderr, res.stderr


def test_no_real_template_makes_the_audit_an_internal_error():
    """Every tokenizer under the plain builder and its own family's (thinking on, then off with both append
    roles), and under a family whose markup it lacks: findings, or one line of bad input, never exit 3."""
    from rlbench.errors import BadInput

    own = {
        **{k: v[0] for k, v in FIXED.items()},
        **{k: FIXED[v[0]][0] for k, v in ORIGINAL.items()},
        "deepseek-v32": "deepseekv32",
        "deepseek-v4": "deepseekv4",
    }
    for name in sorted(p.name for p in TOKENIZERS.iterdir() if p.is_dir()):
        for family, roles, kwargs in (
            (None, None, {}),
            (own[name], None, {"enable_thinking": True}),
            (own[name], ["tool", "user"], {"enable_thinking": False}),
        ):
            try:
                _audit(name, family, roles, kwargs)
            except BadInput as exc:
                assert "No SUPPORTED_TEMPLATES row" in str(exc) or "the tokenizer has no chat template" in str(exc)
        with pytest.raises(BadInput, match="lacks the family's markup|has no chat template"):
            _audit(name, "kimi25" if own[name] != "kimi25" else "glm47", ["tool", "user"])
