"""`tito.render` renders the compiled chat template directly; it must give the very text that
`apply_chat_template` gives, for every fixture tokenizer, shape and generation flag."""

from __future__ import annotations

import re

import pytest
from jinja2 import TemplateError

from rlbench.checks.tito import render
from rlbench.checks.tito_shapes import conversation_shapes
from rlbench.core.model import load_tokenizer
from tests.conftest import REPO

NAMES = sorted(p.name for p in (REPO / "rlbench" / "fixtures" / "tokenizers").iterdir())


@pytest.mark.parametrize("name", NAMES)
def test_render_equals_apply_chat_template(name):
    tok = load_tokenizer(REPO / "rlbench" / "fixtures" / "tokenizers" / name)
    for messages, tools in conversation_shapes().values():
        for cut in range(1, len(messages) + 1):
            for generation in (False, True):
                try:
                    want = tok.apply_chat_template(
                        messages[:cut], tools=tools, add_generation_prompt=generation, tokenize=False
                    )
                except TemplateError as exc:  # a template that refuses a shape refuses it on both paths
                    with pytest.raises(TemplateError, match=re.escape(str(exc))):
                        render(tok, messages[:cut], tools, generation)
                    continue
                assert render(tok, messages[:cut], tools, generation) == want


@pytest.mark.parametrize("name", ["qwen-tiny", "tito-special"])
def test_byte_table_decode_equals_the_tokenizers(name):
    """`tito.decode` joins per-id bytes for byte-level BPEs; on random ids (invalid UTF-8 pieces and
    special tokens included) it must give the tokenizer's own text."""
    import random

    from rlbench.checks.tito import _byte_table, decode

    tok = load_tokenizer(REPO / "rlbench" / "fixtures" / "tokenizers" / name)
    assert _byte_table(tok) is not None
    rng = random.Random(0)
    for _ in range(20_000):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 40))]
        assert decode(tok, ids) == tok.backend_tokenizer.decode(ids, skip_special_tokens=False)


MILES = REPO / "tests" / "conformance" / "miles" / "tokenizers"


@pytest.mark.parametrize("name", ["qwen3", "glm47", "kimi25-fixed", "minimax-m25-fixed", "qwen35-fixed"])
def test_render_with_kwargs_and_none_valued_keys_equals_apply_chat_template(name):
    """Real chat templates (tests/conformance/miles), with template kwargs, an OpenAI-style `content: None` (no key
    to transformers, not the text "None") and reasoning under another name (`reasoning`, which transformers also
    passes as `reasoning_content`)."""
    tok = load_tokenizer(MILES / name)
    shapes = conversation_shapes()
    messages, tools = shapes["tool-result-with-tools"]
    messages = [dict(m, content=None) if m.get("tool_calls") else m for m in messages]
    messages[-1] = dict(messages[-1], reasoning="7 is odd")
    for kwargs in ({}, {"enable_thinking": False, "clear_thinking": False, "preserve_thinking": True}):
        for generation in (False, True):
            want = tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation, tokenize=False, **kwargs
            )
            assert render(tok, messages, tools, generation, kwargs) == want
            assert "None" not in want


# Every variable a template may test for: what apply_chat_template gives it, None or undefined alike
PROBE = (
    "{{ documents is none }}|{{ documents is defined }}|{{ tools is none }}|{{ add_generation_prompt }}|"
    "{{ enable_thinking is defined and enable_thinking }}|"
    "{% for m in messages %}{{ m.role }}:{{ m.thinking }}/{{ m.reasoning_content }}/{{ m.reasoning }}/"
    "{{ m.content is defined }};{% endfor %}"
)


@pytest.mark.parametrize("compiled", [True, False])
def test_render_gives_a_template_the_variables_apply_chat_template_gives(compiled):
    """A template that prints what it is given: `documents` defined and None, reasoning under each name transformers
    passes (`thinking`, `reasoning_content`, besides the name it came under), template kwargs, None-valued keys
    absent. On both paths: the compiled template rendered directly, and apply_chat_template where transformers has
    no compiler to hand (rlbench then takes the public path, kwargs and all)."""
    tok = load_tokenizer(REPO / "rlbench" / "fixtures" / "tokenizers" / "tito-clean")
    tok.chat_template = PROBE
    if not compiled:
        tok._rlbench_template = None
    messages = [
        {"role": "user", "content": "Is 7 odd?"},
        {"role": "assistant", "content": None, "reasoning": "7 ends in 7"},
        {"role": "assistant", "content": "odd", "reasoning_content": "it is"},
    ]
    for kwargs in ({}, {"enable_thinking": True}):
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        got = render(tok, messages, None, True, kwargs)
        assert got == want
        assert got.startswith(f"True|True|True|True|{bool(kwargs)}|")
        assert "assistant:7 ends in 7/7 ends in 7/7 ends in 7/False;" in got
        assert "assistant:it is/it is//True;" in got


def test_a_padded_id_decodes_to_nothing_as_in_the_tokenizers_own_decode():
    """Ids past the tokenizer's vocabulary (a model's embedding padded to a multiple, core/vocab.py) have no text: the
    byte-table decode gives the tokenizer's own text for the rest, on either side of them."""
    from rlbench.checks.tito import _byte_table, decode, encode

    tok = load_tokenizer(REPO / "rlbench" / "fixtures" / "tokenizers" / "qwen-tiny")
    assert _byte_table(tok) is not None
    ids, padded = encode(tok, "odd even"), len(tok) + 5
    assert decode(tok, [padded] + ids + [padded, padded]) == "odd even"
    assert decode(tok, [padded] + ids) == tok.backend_tokenizer.decode([padded] + ids, skip_special_tokens=False)
