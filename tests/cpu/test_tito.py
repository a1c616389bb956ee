"""TITO drift classification (rlbench/checks/tito.py) on id sequences built by hand with the fixture tokenizers:
each drift mode from its own cause, the closing whitespace that is not drift, and what a finding shows."""

from __future__ import annotations

import pytest

from rlbench.checks import tito
from rlbench.checks.compare import first_divergence
from rlbench.core.model import load_tokenizer
from tests.conftest import REPO, word_level_tokenizer


@pytest.fixture(scope="module")
def tok():
    """<|im_end|> (2) ends a turn; <tool_call> (316) is a special token, <think> (314) is not."""
    return load_tokenizer(REPO / "rlbench" / "fixtures" / "tokenizers" / "tito-special")


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
    assert classify(tok, chars(tok, "odd") + [2] + enc(tok, "\n"), enc(tok, "odd") + [2] + enc(tok, "\n\n")) == (
        "reencode",
        True,
    )


def test_against_a_rendering_that_goes_on_the_same_text_other_ids_is_reencode_only_when_told_so(tok):
    """The next turn's prompt holds the turn re-encoded and then more: its text starts with the turn's. Told that
    the rendering extends the buffer, that is reencode; not told, the texts differ (position); other text is
    position either way."""
    got, rest = enc(tok, "Is 7 ") + chars(tok, "odd"), enc(tok, " Is 9")
    extended = enc(tok, "Is 7 odd") + rest
    index = first_divergence(got, extended)
    assert tito.classify(tok, got, extended, index, [], [], extends=True) == ("reencode", True)
    assert tito.classify(tok, got, extended, index, [], []) == ("position", True)
    other = enc(tok, "Is 7 even") + rest
    assert tito.classify(tok, got, other, first_divergence(got, other), [], [], extends=True)[0] == "position"


def test_a_finding_against_a_rendering_that_goes_on_is_classified_as_told(tok):
    """finding() passes `extends` on to the classification, and a finding is not told so unless it says it."""
    got, extended = enc(tok, "Is 7 ") + chars(tok, "odd"), enc(tok, "Is 7 odd") + enc(tok, " Is 9")
    index = first_divergence(got, extended)
    assert tito.finding(tok, "s", "w", got, extended, index, [], [], extends=True).mode == "reencode"
    assert tito.finding(tok, "s", "w", got, extended, index, [], []).mode == "position"


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
    assert classify(tok, other + enc(tok, "\n\nx"), other + enc(tok, "x"), turn_ends=[len(other)]) == (
        "separator",
        True,
    )
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
    # the rendering ends where the truncated turn does: nothing closes it there
    assert classify(tok, got, enc(tok, "The answer"), truncated_ends=[n]) != ("truncated", True)


def test_anything_else_is_position(tok):
    assert classify(tok, enc(tok, "odd even"), enc(tok, "even odd")) == ("position", True)
    # ids that are not the canonical ones, but of another text, and no byte lost to U+FFFD
    assert classify(tok, chars(tok, "odd even"), enc(tok, "even odd")) == ("position", True)


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
    assert not tito.only_closing(tok, cut, cut + [2] + enc(tok, "x"), truncated_last=True)  # one end-of-turn only


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
        "multi-turn",
        "final re-render",
        "reencode",
        1,
        True,
    )
    assert (
        found.index == i and found.context == got[i - 3 : i] and found.context_text == tito.decode(tok, got[i - 3 : i])
    )
    assert found.got == got[i : i + 4] and found.expected == expected[i : i + 4] and len(found.got) == 4
    assert (found.got_text, found.expected_text) == (" odd", " odd?")
    near_start = tito.finding(tok, "s", "w", enc(tok, "ab"), enc(tok, "xb"), 0, [], [], mode=("special", False))
    assert (near_start.context, near_start.context_text, near_start.mode, near_start.number, near_start.strict) == (
        [],
        "",
        "special",
        8,
        False,
    )
    early = tito.finding(tok, "s", "w", chars(tok, "abc"), chars(tok, "abx"), 2, [], [], mode=("special", False))
    assert early.context == chars(tok, "ab")  # fewer than three ids before the index: all of them


def test_modes_are_numbered_as_the_research_notes_number_them():
    assert {name: number for name, (number, _) in tito.MODES.items()} == {
        "reencode": 1,
        "separator": 2,
        "stop": 3,
        "reasoning": 4,
        "position": 5,
        "special": 8,
        "truncated": 10,
        "unsampled": 0,  # rlbench's own: a slime plugin's trained span no request of the step sampled
        "template": 0,
        "other": 0,
    }


def test_whitespace_token_and_dropped_look_at_one_id_and_nothing_past_the_end(tok):
    ids = enc(tok, "a\n<tool_call>")
    assert [tito._whitespace_token(tok, ids, i) for i in range(4)] == [False, True, False, False]
    assert [tito.decode_drops(tok, ids, i) for i in range(4)] == [False, False, True, False]


def test_a_lone_byte_counts_within_its_turn_and_from_three_ids_before_the_divergence(tok):
    lone = enc(tok, "x") + [byte_id(tok, 0xE2)] + enc(tok, "y")
    # at the very start of the sequences
    assert classify(tok, lone[1:], enc(tok, "zzy")) == ("reencode", True)
    # at a turn's end: the turn it starts counts, not the one before
    turn = enc(tok, "odd") + [2]
    assert classify(tok, turn + lone[1:], turn + enc(tok, "zzy"), turn_ends=[len(turn), len(turn) + 2]) == (
        "reencode",
        True,
    )
    # in a later turn than the divergence: not what parted the sequences
    first = enc(tok, "odd even") + [2]
    assert classify(tok, first + lone, enc(tok, "even odd") + [2] + lone, turn_ends=[len(first)]) == ("position", True)
    # a U+FFFD sampled as its own ids is text, not a lost byte; only three ids before the divergence are looked at,
    # so the non-canonical pair "a" "n" counts at index 3 and not at index 4
    got = chars(tok, "an") + enc(tok, "q") + enc(tok, "z") + enc(tok, "\ufffd") + enc(tok, "z")
    assert [tito.classify(tok, got, got[:k] + enc(tok, "x"), k, [], []) for k in (3, 4)] == [
        ("reencode", True),
        ("position", True),
    ]


def test_reasoning_is_a_think_block_within_eight_ids_of_the_divergence_on_one_side(tok):
    def think_after(k):  # a think block k + 1 ids after the divergence, on one side
        return classify(
            tok,
            enc(tok, "odd") + chars(tok, "a" * k) + enc(tok, "<think>x</think>"),
            enc(tok, "even") + chars(tok, "a" * k),
        )

    assert [think_after(k) for k in (6, 7)] == [("reasoning", True), ("position", True)]
    # a think block both sides share before the divergence does not hide one that only one side has after it
    kept = enc(tok, "<think>a</think>")
    assert classify(tok, kept + enc(tok, "<think>b</think>odd"), kept + enc(tok, "odd")) == ("reasoning", True)


def test_a_turn_boundary_needs_an_end_of_turn_before_the_index(tok):
    assert classify(tok, [2] + enc(tok, "\nx"), [2] + enc(tok, "x")) == ("separator", True)
    # at index 0 nothing comes before it (the last id of the sequence is no end-of-turn before it)
    assert classify(tok, enc(tok, "\nodd") + [2], enc(tok, "odd") + [2]) == ("position", True)


def test_whitespace_of_a_multi_byte_character_sampled_byte_by_byte_is_separator(tok):
    """No single id of an ideographic space (U+3000) sampled as its three bytes is whitespace, its text is."""
    turn = enc(tok, "odd") + [2]
    ideographic = [byte_id(tok, b) for b in "\u3000".encode()]
    em = [byte_id(tok, b) for b in "\u2003".encode()]
    spaces = enc(tok, " ") * 2
    # whitespace on both sides, other whitespace
    assert classify(tok, turn + ideographic * 2 + spaces + enc(tok, "x"), turn + em * 2 + spaces + enc(tok, "x")) == (
        "separator",
        True,
    )
    # on one side only, text on the other
    assert classify(tok, turn + ideographic * 2 + spaces + enc(tok, "x"), turn + enc(tok, "x")) == ("position", True)
    # one side ends at the boundary, the other goes on with whitespace only (more ids than are decoded to classify)
    assert classify(tok, turn, turn + ideographic * 3) == ("separator", True)
    assert classify(tok, turn + ideographic * 3, turn) == ("separator", True)
    # or with text
    assert classify(tok, turn, turn + enc(tok, "x")) == ("position", True)
    assert classify(tok, turn + enc(tok, "x"), turn) == ("position", True)


# ---------------------------------------------------------------- encode, decode and render on other tokenizers


def _fresh(name="tito-special"):
    return load_tokenizer(REPO / "rlbench" / "fixtures" / "tokenizers" / name)


def _refuse(*args, **kwargs):
    raise AssertionError("transformers' Python wrapper was called")


def test_the_fast_paths_skip_transformers_wrapper_and_are_built_once():
    """render, encode and decode go to the compiled template and the Rust tokenizer, not through the tokenizer's
    Python methods (their cost, bench/tito_throughput.py); the compiled template, byte table and special ids are
    made once per tokenizer."""
    from rlbench.checks.tito_shapes import conversation_shapes

    class Counting:  # the Rust tokenizer, its decode calls counted
        def __init__(self, backend):
            self.backend, self.decodes = backend, 0

        def __getattr__(self, name):
            return getattr(self.backend, name)

        def decode(self, *args, **kwargs):
            self.decodes += 1
            return self.backend.decode(*args, **kwargs)

    tok = _fresh()
    messages, tools = conversation_shapes()["tool-result-with-tools"]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    skipped = tok.decode(ids, skip_special_tokens=True)
    tok.apply_chat_template = tok.encode = tok.decode = _refuse
    tok._tokenizer = backend = Counting(tok.backend_tokenizer)
    assert tito.render(tok, messages, tools, True) == text
    assert tito.encode(tok, text) == ids and tito.decode(tok, ids) == text
    assert backend.decodes == 0  # a byte-level BPE's ids decode by its byte table
    assert tito.decode(tok, ids, skip_special_tokens=True) == skipped and backend.decodes == 1  # that one cannot
    assert tito._compiled(tok) is tito._compiled(tok) and tito._byte_table(tok) is tito._byte_table(tok)
    assert tito.decode_drops(tok, [316], 0)
    special = tok._rlbench_special
    assert tito.decode_drops(tok, [316], 0) and tok._rlbench_special is special


def test_encode_never_adds_special_tokens_and_a_tokenizer_without_a_rust_backend_works_too():
    """A tokenizer that adds a BOS when asked (Llama's do): the sampled ids never have one. A "slow" tokenizer
    (no backend_tokenizer) is encoded and decoded through its own methods, to the same ids and text."""
    from tokenizers import processors

    tok = _fresh()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    assert tok.encode("odd") == [1, *tok.encode("odd", add_special_tokens=False)]

    class Slow:
        eos_token_id = tok.eos_token_id

        def encode(self, text, add_special_tokens=True):
            return tok.encode(text, add_special_tokens=add_special_tokens)

        def decode(self, ids, skip_special_tokens=False):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "Is 7 odd?<tool_call>x</tool_call><|im_end|>\n"
    ids = tok.encode(text, add_special_tokens=False)
    for t in (tok, Slow()):
        assert tito.encode(t, text) == ids and tito.decode(t, ids) == text
        assert tito.decode(t, ids, skip_special_tokens=True) == "Is 7 odd?x\n"
        assert tito.decode(t, tuple(ids)) == text  # any sequence of ids
    assert tito._byte_table(Slow()) is None


def test_a_tokenizer_that_is_not_byte_level_decodes_through_its_own_decoder():
    tok = word_level_tokenizer()
    assert tito._byte_table(tok) is None
    assert tito.decode(tok, [1, 3, 2]) == tok.decode([1, 3, 2]) == "odd <eot> even"
    assert tito.decode(tok, [1, 3, 2], skip_special_tokens=True) == "odd even"
    with pytest.raises(ValueError, match="chat_template is not set"):  # transformers' own words
        tito.render(tok, [{"role": "user", "content": "odd"}], None, True)


def test_added_tokens_of_any_characters_decode_as_their_text():
    """DeepSeek's added tokens are full-width characters, outside the byte-level alphabet."""
    tok = _fresh()
    tok.add_tokens(["<｜tool▁sep｜>"])
    ids = enc(tok, "odd<｜tool▁sep｜>even")
    assert tito.decode(tok, ids) == "odd<｜tool▁sep｜>even" == tok.decode(ids)


def test_render_without_transformers_private_compiler_is_the_public_path(monkeypatch):
    """A transformers that no longer has the private compiler: render falls back to apply_chat_template."""
    import sys
    import types

    from rlbench.checks.tito_shapes import conversation_shapes

    # rlbench's import sees a module without it; transformers' own code keeps its module
    monkeypatch.setitem(sys.modules, "transformers.utils.chat_template_utils", types.ModuleType("without"))
    tok = _fresh("tito-clean")
    messages, tools = conversation_shapes()["tool-result-with-tools"]
    for generation in (False, True):
        want = tok.apply_chat_template(messages[:2], tools=tools, add_generation_prompt=generation, tokenize=False)
        assert tito.render(tok, messages[:2], tools, generation) == want
    assert tito._compiled(tok) is None


# --------------------------------------------------------------------------- every divergence, each its own mode


def test_every_divergence_is_found_each_classified_on_its_own(tok):
    """A separator lost after the first turn and, later, a reasoning block the rendering drops: both are named, in
    order, each where its ids part (the second in the expected sequence's own place too)."""
    first, second = enc(tok, "odd") + [2], enc(tok, "<think>12 ends in 2</think>even") + [2]
    user = enc(tok, "<|im_start|>user\nAnd 12?")
    got = first + user + second
    expected = first + enc(tok, "\n") + user + enc(tok, "even") + [2]
    found = tito.block_findings(tok, "s", "w", got, expected, [len(first), len(got)], [], reasoning=("12 ends in 2",))
    assert [(f.mode, f.index) for f in found] == [("separator", len(first)), ("reasoning", len(first + user))]
    assert found[1].expected_index == len(first) + 1 + len(user)
    assert tito.block_findings(tok, "s", "w", got, list(got), [], []) == []


def test_a_stop_sampled_last_is_closing_and_a_second_one_is_not(tok):
    turn = enc(tok, "odd")
    assert tito.divergences(tok, turn + [2], turn, stops=frozenset({2})) == []
    assert tito.divergences(tok, turn + [2, 2], turn, stops=frozenset({2}))
    assert tito.divergences(tok, turn + [2], turn) == [(len(turn), len(turn) + 1, len(turn), len(turn))]


def test_a_stop_that_opens_the_next_turn_kept_twice_is_stop(tok):
    """Mode 3: a builder appended the rendered opener after a sampled stop that is the same id (GLM's <|user|>)."""
    turn, rest = enc(tok, "odd") + [1], enc(tok, "user\nAnd 12?")
    f = tito.block_findings(tok, "s", "w", turn + [1] + rest, turn + rest, [len(turn)], [], stops=frozenset({1, 2}))
    assert [(x.mode, x.number) for x in f] == [("stop", 3)]


def test_a_decode_that_skipped_the_end_of_turn_is_special(tok):
    """Mode 8 for <|im_end|> too, and for the separator a builder then leaves out after it."""
    head, rest = enc(tok, "odd"), [1] + enc(tok, "user\nAnd 12?")
    expected = head + [2] + enc(tok, "\n") + rest
    [f] = tito.block_findings(tok, "s", "w", head + rest, expected, [], [], stops=frozenset({2}))
    assert (f.mode, f.number, f.index) == ("special", 8, len(head))


def test_one_change_split_by_a_shared_id_is_one_divergence(tok):
    """The alignment matches 'e' inside 'Hello' and 'Bye': still one divergence."""
    [f] = tito.block_findings(tok, "s", "w", enc(tok, "Bye") + [2], enc(tok, "Hello") + [2], [], [])
    assert f.index == 0


def test_a_special_token_sampled_where_the_rendering_has_a_stop_is_a_swap_and_a_stop(tok):
    """Mode 3, not mode 8: the sampled side has <|im_start|> (special, no stop) where the rendering has <|im_end|> (a
    stop). Both read the same once special tokens are skipped, but nothing was dropped: one special stands for
    another. And a stop on the sampled side only, with the rendering's own id special but no stop, is a stop too."""
    head, rest = enc(tok, "odd"), enc(tok, "user\nAnd 12?")
    [f] = tito.block_findings(tok, "s", "w", head + [1] + rest, head + [2] + rest, [], [], stops=frozenset({2}))
    assert (f.mode, f.number, f.index) == ("stop", 3, len(head))
    [f] = tito.block_findings(tok, "s", "w", head + [2] + rest, head + [1] + rest, [], [], stops=frozenset({2}))
    assert (f.mode, f.number, f.index) == ("stop", 3, len(head))
    [f] = tito.block_findings(tok, "s", "w", head + [1] + rest, head + [2] + rest, [], [])  # no stops: a special
    assert f.mode != "stop"
    for extra in (rest, [2]):  # sampled past the rendering's end: a stop only where the id sampled there is one
        mode = tito.classify(tok, head + extra, head, len(head), [], [], frozenset({2}))
        assert (mode[0] == "stop") == (extra == [2]), (extra, mode)


def test_neighbouring_blocks_are_one_change_across_two_plain_ids_or_a_resegmentation_across_three(tok):
    """_joined: two changes with two plain ids between are one divergence, with three they are two, unless their joint
    stretch reads the same on both sides (a re-segmentation: 'e'+'nnn'+'n' against 'en'+'nnn'), and with four always
    two. Wherever in the sequence they stand."""
    a, b, c, d, x = (enc(tok, t)[0] for t in ("a", "b", "odd", "even", "x"))
    e, n, en = (enc(tok, t)[0] for t in ("e", "n", "en"))
    for head in ([], enc(tok, "odd even odd")):
        at = len(head)
        assert tito.divergences(tok, head + [a, x, x, b], head + [c, x, x, d]) == [(at, at + 4, at, at + 4)]
        assert len(tito.divergences(tok, head + [a, x, x, x, b], head + [c, x, x, x, d])) == 2
        assert tito.divergences(tok, head + [e, n, n, n, n], head + [en, n, n, n]) == [(at, at + 5, at, at + 4)]
        assert len(tito.divergences(tok, head + [e, n, n, n, n, n], head + [en, n, n, n, n])) == 2


def test_what_a_rendering_closes_a_truncated_last_turn_with_is_one_stop_id_and_whitespace(tok):
    """_closing: after a truncated last turn the rendering may add one end-of-turn, or one of the stop ids, and
    whitespace: no divergence. Anything more is one."""
    turn = enc(tok, "odd")
    for closer, stops in (([2], frozenset()), ([1], frozenset({1}))):
        assert tito.divergences(tok, turn, turn + closer + enc(tok, "\n"), True, stops) == []
        assert tito.divergences(tok, turn, turn + closer + enc(tok, "x"), True, stops)
        assert tito.divergences(tok, turn, turn + closer + closer, True, stops)
    assert tito.divergences(tok, turn, turn + [1] + enc(tok, "\n"), True)  # not a stop


def test_a_long_sequence_is_aligned_on_every_id_however_common(tok):
    """difflib junks ids that fill more than 1% of a sequence of 200 or more (autojunk), and then aligns nothing on
    them: a long run of one id around a single change would read as one change of the whole sequence."""
    x, a, b = (enc(tok, t)[0] for t in ("x", "a", "b"))
    got, expected = [x] * 150 + [a] + [x] * 150, [x] * 150 + [b] + [x] * 150
    assert tito.divergences(tok, got, expected) == [(150, 151, 150, 151)]


def test_specials_dropped_reads_the_text_whitespace_aside_and_a_sampled_special_within_its_window(tok):
    """Mode 8 needs the text to read the same once special tokens are skipped, spaces between words aside (a decode
    that skipped <|im_end|> also loses the separator a builder puts after it); a re-segmented sampled word still reads
    the same. Where the sampled side has other text, a rendered stop is a stop (mode 3). And a special token sampled
    at the divergence is looked for among the rendering's next SPECIALS_WINDOW ids (specials and whitespace between):
    found there, the ones before it were dropped (mode 8); further on, it is a swap (mode 3)."""
    head, nl = enc(tok, "odd"), enc(tok, "\n")[0]
    assert tito._same_without_specials(tok, enc(tok, "a b"), [2] + enc(tok, "ab"))
    assert not tito._same_without_specials(tok, enc(tok, "a b"), [2] + enc(tok, "ax"))
    user, us_er = enc(tok, "user"), enc(tok, "us") + enc(tok, "er")
    [f] = tito.block_findings(tok, "s", "w", head + user, head + [2] + us_er, [], [], stops=frozenset({2}))
    assert f.mode == "special"
    [f] = tito.block_findings(
        tok, "s", "w", head + enc(tok, " abc"), head + [2] + enc(tok, " xyz"), [], [], stops=frozenset({2})
    )
    assert f.mode == "stop"
    rest = enc(tok, "user\nAnd 12?")
    near = head + [2] + [nl] * (tito.SPECIALS_WINDOW - 2) + [1] + rest
    far = head + [2] + [nl] * (tito.SPECIALS_WINDOW - 1) + [1] + rest
    assert tito.classify(tok, head + [1] + rest, near, len(head), [], [], frozenset({2})) == ("special", True)
    assert tito.classify(tok, head + [1] + rest, far, len(head), [], [], frozenset({2})) == ("stop", True)
