"""`tito.render` renders the compiled chat template directly; it must give the very text that
`apply_chat_template` gives, for every fixture tokenizer, shape and generation flag."""

from __future__ import annotations

import pytest

from rlbench.checks.tito import SHAPES, render
from rlbench.core.model import load_tokenizer
from tests.conftest import REPO

NAMES = sorted(p.name for p in (REPO / "fixtures" / "tokenizers").iterdir())


@pytest.mark.parametrize("name", NAMES)
def test_render_equals_apply_chat_template(name):
    tok = load_tokenizer(REPO / "fixtures" / "tokenizers" / name)
    for messages, tools in SHAPES.values():
        for cut in range(1, len(messages) + 1):
            for generation in (False, True):
                want = tok.apply_chat_template(messages[:cut], tools=tools, add_generation_prompt=generation,
                                               tokenize=False)
                assert render(tok, messages[:cut], tools, generation) == want
