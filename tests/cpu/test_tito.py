"""TITO drift classification (rlbench/checks/tito.py) on id sequences built by hand with the fixture tokenizers:
each drift mode from its own cause, the closing whitespace that is not drift, and what a finding shows."""

from __future__ import annotations

import pytest

from rlbench.checks import tito
from rlbench.core.model import load_tokenizer
from tests.conftest import REPO


@pytest.fixture(scope="module")
def tok():
    """<|im_end|> (2) ends a turn; <tool_call> (316) is a special token, <think> (314) is not."""
    return load_tokenizer(REPO / "fixtures" / "tokenizers" / "tito-special")


def enc(tok, text):
    return tito.encode(tok, text)


def chars(tok, text):
    """`text` as one id per character: the same text, not the ids the tokenizer would give it."""
    return [i for c in text for i in enc(tok, c)]


def byte_id(tok, byte: int) -> int:
    return next(i for i, b in tito._byte_table(tok).items() if b == bytes([byte]))


def classify(tok, got, expected, turn_ends=(), truncated_ends=()):
    from rlbench.checks.compare import first_divergence

    return tito.classify(tok, got, expected, first_divergence(got, expected), list(turn_ends), list(truncated_ends))


def test_encode_and_decode_are_the_tokenizers(tok):
    t = tok
    text = "Is 7 odd?<tool_call>x</tool_call><|im_end|>\n"
    assert enc(t, text) == t.encode(text, add_special_tokens=False)
    ids = enc(t, text)
    assert tito.decode(t, ids) == text == t.decode(ids)
    assert tito.decode(t, ids, skip_special_tokens=True) == t.decode(ids, skip_special_tokens=True) == "Is 7 odd?x\n"
    assert tito.decode_many(t, [ids[:2], [], ids]) == [t.decode(ids[:2]), "", text]
    assert tito.canonical(t, chars(t, "odd")) == enc(t, "odd") != chars(t, "odd")


def test_same_text_other_ids_is_reencode(tok):
    assert classify(tok, enc(tok, "Is 7 ") + chars(tok, "odd"), enc(tok, "Is 7 odd")) == ("reencode", True)
    # the same text apart from whitespace the rendering adds at the very end
    assert classify(tok, chars(tok, "odd") + [2] + enc(tok, "\n"), enc(tok, "odd") + [2] + enc(tok, "\n\n")) \
        == ("reencode", True)


def test_a_lone_byte_decoded_to_a_replacement_character_is_reencode(tok):
    got = enc(tok, "x") + [byte_id(tok, 0xE2)] + enc(tok, "y")  # 0xE2 starts a 3-byte character: no text alone
    assert "\ufffd" in tito.decode(tok, got)
    assert classify(tok, got, enc(tok, "xzzy")) == ("reencode", True)


def test_reasoning_on_one_side_only_is_reasoning(tok):
    assert classify(tok, enc(tok, "<think>7 ends in 7</think>odd"), enc(tok, "odd")) == ("reasoning", True)
    assert classify(tok, enc(tok, "odd"), enc(tok, "<think>7</think>odd")) == ("reasoning", True)


def test_whitespace_at_a_turn_boundary_is_separator(tok):
    turn = enc(tok, "odd") + [2]
    assert classify(tok, turn + enc(tok, "\nAnd 12?"), turn + enc(tok, "And 12?")) == ("separator", True)
    assert classify(tok, turn + enc(tok, "And 12?"), turn + enc(tok, "\nAnd 12?")) == ("separator", True)
    # the buffer ends at the boundary and the rendering adds only whitespace there (index past `got`)
    assert classify(tok, turn, turn + enc(tok, "\n"), turn_ends=[len(turn)]) == ("separator", True)
    assert classify(tok, turn + enc(tok, "\n"), turn, turn_ends=[len(turn)]) == ("separator", True)
    # a boundary named by turn_ends, not by an end-of-turn id before it
    other = enc(tok, "odd")
    assert classify(tok, other + enc(tok, "\n\nx"), other + enc(tok, "x"), turn_ends=[len(other)]) == ("separator", True)
    assert classify(tok, other + enc(tok, "\n\nx"), other + enc(tok, "x")) != ("separator", True)


def test_a_dropped_special_token_is_special(tok):
    assert classify(tok, enc(tok, "a<tool_call>b"), enc(tok, "ab")) == ("special", True)
    assert classify(tok, enc(tok, "ab"), enc(tok, "a<tool_call>b")) == ("special", True)
    assert classify(tok, enc(tok, "a<think>b"), enc(tok, "ab")) != ("special", True)  # <think> is not special


def test_a_continued_truncated_turn_is_truncated(tok):
    got = enc(tok, "The answer") + enc(tok, "Go on.")
    expected = enc(tok, "The answer") + [2] + enc(tok, "Go on.")
    n = len(enc(tok, "The answer"))
    assert classify(tok, got, expected, truncated_ends=[n]) == ("truncated", True)
    assert classify(tok, got, expected, truncated_ends=[n + 1]) != ("truncated", True)


def test_anything_else_is_position(tok):
    assert classify(tok, enc(tok, "odd even"), enc(tok, "even odd")) == ("position", True)


def test_only_closing_whitespace_or_a_closing_end_of_turn_is_not_drift(tok):
    turn = enc(tok, "odd") + [2]
    assert tito.only_closing(tok, turn, turn + enc(tok, "\n"), False)
    assert tito.only_closing(tok, turn, turn, False)
    assert not tito.only_closing(tok, turn, turn + enc(tok, "x"), False)
    assert not tito.only_closing(tok, turn, enc(tok, "even") + [2, *enc(tok, "\n")], False)  # not a prefix
    cut = enc(tok, "The answer")
    assert tito.only_closing(tok, cut, cut + [2] + enc(tok, "\n"), truncated_last=True)
    assert tito.only_closing(tok, cut, cut + [2], truncated_last=True)
    assert not tito.only_closing(tok, cut, cut + [2], truncated_last=False)
    assert not tito.only_closing(tok, cut, cut + enc(tok, "\n") + [2], truncated_last=True)


def test_divergence_is_none_only_for_equal_ids_or_closing_whitespace(tok):
    turn = enc(tok, "odd") + [2]
    assert tito.divergence(tok, "s", "w", turn, list(turn), [], []) is None
    assert tito.divergence(tok, "s", "w", turn, turn + enc(tok, "\n"), [], []) is None
    assert tito.divergence(tok, "s", "w", enc(tok, "cut"), enc(tok, "cut") + [2], [], [], truncated_last=True) is None
    found = tito.divergence(tok, "s", "w", enc(tok, "cut"), enc(tok, "cut") + [2], [], [])
    assert (found.index, found.expected, found.got) == (len(enc(tok, "cut")), [2], [])


def test_a_finding_shows_both_sides_from_the_index_and_the_ids_before_it(tok):
    got = enc(tok, "Is 7 even or") + chars(tok, " odd") + enc(tok, "?")
    expected = enc(tok, "Is 7 even or odd?")
    found = tito.divergence(tok, "multi-turn", "final re-render", got, expected, [], [])
    i = len(enc(tok, "Is 7 even or"))
    assert (found.shape, found.where, found.mode, found.number, found.strict) == (
        "multi-turn", "final re-render", "reencode", 1, True)
    assert found.index == i and found.context == got[i - 3:i] and found.context_text == tito.decode(tok, got[i - 3:i])
    assert found.got == got[i:i + 4] and found.expected == expected[i:i + 4] and len(found.got) == 4
    assert (found.got_text, found.expected_text) == (" odd", " odd?")
    near_start = tito.finding(tok, "s", "w", enc(tok, "ab"), enc(tok, "xb"), 0, [], [], mode=("special", False))
    assert (near_start.context, near_start.context_text, near_start.mode, near_start.number, near_start.strict) == (
        [], "", "special", 8, False)


def test_modes_are_numbered_as_the_research_notes_number_them():
    assert {name: number for name, (number, _) in tito.MODES.items()} == {
        "reencode": 1, "separator": 2, "reasoning": 4, "position": 5, "special": 8, "truncated": 10, "template": 0,
        "other": 0}


def test_whitespace_token_and_dropped_look_at_one_id_and_nothing_past_the_end(tok):
    ids = enc(tok, "a\n<tool_call>")
    assert [tito._whitespace_token(tok, ids, i) for i in range(4)] == [False, True, False, False]
    assert [tito._dropped(tok, ids, i) for i in range(4)] == [False, False, True, False]
