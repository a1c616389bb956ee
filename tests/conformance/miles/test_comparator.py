"""Miles' TokenSeqComparator on its own test cases (tests/fast/utils/chat_template_utils/test_token_seq_comparator.py
in radixark/miles, there on the Qwen3-4B and GLM-4.7-Flash hub tokenizers), rebuilt on the offline tokenizers: the
category rlbench gives each divergence is the type Miles' comparator reports for it; and where Miles' text comparison
sees nothing, a same-text re-segmentation, rlbench still finds mode 1 (category "none"). One deliberate difference:
Miles trims any number of trailing stop ids; rlbench leaves out only the one an engine stops at."""

from __future__ import annotations

import pytest

from rlbench.checks.tito import block_findings, encode
from tests.conformance.miles.common import stops, tokenizer

# Miles' ModelConfig: assistant start and the special tokens its cases use, per model
MODELS = {
    "qwen3-fixed": ("<|im_start|>assistant", ("<|im_start|>", "<|im_end|>", "<|endoftext|>")),
    "glm47": ("<|assistant|>", ("<|assistant|>", "<|user|>", "<|system|>", "<|observation|>", "<|endoftext|>")),
}


class Env:
    def __init__(self, name: str, trim: set[int] | None = None):
        from miles_tito_tokenizers import TokenSeqComparator

        self.name, self.tok = name, tokenizer(name)
        self.start, self.specials = MODELS[name]
        self.compare = TokenSeqComparator(self.tok, assistant_start_str=self.start, trim_trailing_ids=trim)

    def id(self, token: str) -> int:
        return self.tok.convert_tokens_to_ids(token)

    def enc(self, text: str) -> list[int]:
        return encode(self.tok, text)

    def miles(self, expected, actual) -> list[str]:
        return [m.type.value for m in self.compare.compare_sequences(expected, actual)]

    def rlbench(self, expected, actual):
        return block_findings(
            self.tok, "case", "miles", actual, expected, [], [], stops=stops(self.name), compare=self.compare
        )


@pytest.fixture(params=sorted(MODELS))
def env(request) -> Env:
    return Env(request.param)


def _agree(env: Env, expected, actual) -> list:
    """Both find a difference, and rlbench's categories are exactly the types Miles reports."""
    miles, found = env.miles(expected, actual), env.rlbench(expected, actual)
    assert miles and found, (miles, found)
    assert {f.category for f in found} == set(miles), ([f.category for f in found], miles)
    return found


def test_identical_and_empty_sequences_differ_nowhere(env):
    sp = env.id(env.specials[0])
    ids = [sp] + env.enc("Hello world") + [sp]
    assert env.miles(ids, ids) == [] and env.rlbench(ids, list(ids)) == []
    assert env.miles([], []) == [] and env.rlbench([], []) == []


def test_a_missing_special_token_is_special_token_count(env):
    sp1, sp2 = env.id(env.specials[0]), env.id(env.specials[1])
    text = env.enc("hi")
    [f] = _agree(env, [sp1] + text + [sp2], [sp1] + text)
    assert f.category == "special_token_count"


def test_a_swapped_special_token_is_special_token_type(env):
    a, b = env.id(env.specials[0]), env.id(env.specials[1])
    text = env.enc("content")
    [f] = _agree(env, [a] + text + [a], [b] + text + [a])
    assert (f.category, f.index) == ("special_token_type", 0)


def test_changed_text_after_a_non_assistant_special_is_non_assistant_text(env):
    sp = env.id(env.specials[1])
    found = _agree(env, [sp] + env.enc("Hello world") + [sp], [sp] + env.enc("Goodbye world") + [sp])
    assert {f.category for f in found} == {"non_assistant_text"}


@pytest.mark.parametrize(
    "name,opener,closer,role,category",
    [
        ("qwen3-fixed", "<|im_start|>", "<|im_end|>", "assistant\n", "assistant_text"),
        ("qwen3-fixed", "<|im_start|>", "<|im_end|>", "user\n", "non_assistant_text"),
        ("glm47", "<|assistant|>", "<|user|>", "", "assistant_text"),
        ("glm47", "<|user|>", "<|assistant|>", "", "non_assistant_text"),
    ],
)
def test_assistant_and_other_text_as_each_template_opens_a_turn(name, opener, closer, role, category):
    e = Env(name)
    o, c = e.id(opener), e.id(closer)
    found = _agree(e, [o] + e.enc(role + "Hello") + [c], [o] + e.enc(role + "Goodbye") + [c])
    assert {f.category for f in found} == {category}


def test_both_kinds_of_text_in_one_sequence():
    e = Env("qwen3-fixed")
    s, t = e.id("<|im_start|>"), e.id("<|im_end|>")
    expected = [s] + e.enc("user\nHello") + [t] + [s] + e.enc("assistant\nHi") + [t]
    actual = [s] + e.enc("user\nBye") + [t] + [s] + e.enc("assistant\nBye") + [t]
    found = _agree(e, expected, actual)
    assert [f.category for f in found] == ["non_assistant_text", "assistant_text"]  # rlbench: each where it is


def test_glm_user_and_observation_swapped_is_a_stop_token_of_the_wrong_kind():
    """<|user|> and <|observation|> both open the turn after an assistant's, and both are GLM stops: swapped,
    Miles says special_token_type at segment 2, rlbench mode 3 there."""
    e = Env("glm47")
    user, obs, asst = e.id("<|user|>"), e.id("<|observation|>"), e.id("<|assistant|>")
    text = e.enc("some content")
    expected = [asst] + text + [user] + text + [asst]
    [f] = _agree(e, expected, [asst] + text + [obs] + text + [asst])
    assert (f.category, f.mode, f.number, f.index) == ("special_token_type", "stop", 3, 1 + len(text))


def test_trailing_stop_tokens():
    """Miles trims the trailing ids it is given, any number; rlbench leaves out the one stop id an engine ends on,
    and a second one after it is a finding (nothing is sampled after a stop)."""
    e = Env("qwen3-fixed")
    sp, eos = e.id("<|im_start|>"), e.id("<|im_end|>")
    text = e.enc("same content")
    expected = [sp] + text + [sp]
    trimmed = Env("qwen3-fixed", trim={eos})
    assert trimmed.miles(expected, [sp] + text + [sp, eos]) == [] == e.rlbench(expected, [sp] + text + [sp, eos])
    assert trimmed.miles(expected, [sp] + text + [sp, eos, eos]) == []
    [f] = e.rlbench(expected, [sp] + text + [sp, eos, eos])
    assert f.mode == "stop"
    assert trimmed.miles([sp] + text + [eos] + text + [sp], [sp] + text + [eos] + text + [sp]) == []  # mid: kept


def test_a_same_text_resegmentation_is_found_by_ids_only():
    """Where rlbench is right and Miles is not: the assistant's reply sampled as other ids of the same text (a
    pipeline that built it piecewise) is no mismatch to Miles' text comparison; rlbench finds mode 1 there."""
    e = Env("qwen3-fixed")
    s, t = e.id("<|im_start|>"), e.id("<|im_end|>")
    word = next(w for w in ("Beijing", "weather", "sunny", "Shanghai") if len(e.enc(w)) == 1)
    pieces = e.enc(word[:3]) + e.enc(word[3:])
    head = [s] + e.enc("assistant\n")
    assert pieces != e.enc(word)
    expected, actual = head + e.enc(word) + [t], head + pieces + [t]
    assert e.miles(expected, actual) == []
    [f] = e.rlbench(expected, actual)
    assert (f.mode, f.number, f.category, f.index) == ("reencode", 1, "none", len(head))


def test_a_rendering_that_goes_on_past_the_sampled_ids_is_compared_only_as_far_as_they_go(env):
    """block_findings(extension=True): the next turn's prompt, after the ids a turn sampled, is no divergence, and
    Miles' comparator is asked about the part that stands against the sampled ids only: the category is the one it
    gives there, not special_token_count for the prompt's own special tokens."""
    sp = env.id(env.specials[1])
    actual = [sp] + env.enc("Hello world") + [sp]
    turn = [sp] + env.enc("Goodbye world") + [sp]
    expected = turn + [sp] + env.enc("user\nnext")
    found = block_findings(
        env.tok, "case", "miles", actual, expected, [], [], stops=stops(env.name), extension=True, compare=env.compare
    )
    assert [f.category for f in found] == env.miles(turn, actual) == ["non_assistant_text"]
