"""The committed fixtures are exactly what `fixtures/build.py` builds, offline, today."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO

FIXTURES = REPO / "rlbench" / "fixtures"
BUILT_FILES = {
    "tokenizers/qwen-tiny/tokenizer.json",
    "tokenizers/qwen-tiny/tokenizer_config.json",
    *(
        f"tokenizers/tito-{n}/{f}"
        for n in ("clean", "reencode", "separator", "reasoning", "position", "special", "truncated", "function")
        for f in ("tokenizer.json", "tokenizer_config.json")
    ),
    "models/tiny-qwen3/config.json",
    "models/tiny-qwen3-tito/config.json",
    "data/parity.jsonl",
    "data/calc.jsonl",
}


def _builder():
    spec = importlib.util.spec_from_file_location("fixtures_build", FIXTURES / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rebuild_equals_committed(tmp_path):
    written = _builder().build(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in written} == BUILT_FILES
    for rel in sorted(BUILT_FILES):
        same = (tmp_path / rel).read_bytes() == (FIXTURES / rel).read_bytes()  # a bool: no difflib over bytes
        assert same, f"{rel} differs from a rebuild"


def test_fixtures_load_and_agree():
    from rlbench.core.model import build_model, load_tokenizer

    tokenizer = load_tokenizer(FIXTURES / "tokenizers" / "qwen-tiny")
    model = build_model(FIXTURES / "models" / "tiny-qwen3", master_seed=0, init="random")
    assert model.config.model_type == "qwen3"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Is 37 even or odd?"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    text = tokenizer.decode(ids)
    assert text == "<|im_start|>user\nIs 37 even or odd?<|im_end|>\n<|im_start|>assistant\n"
    # Qwen2's pre-tokenizer splits digits one by one; the byte-level alphabet encodes any text.
    assert "3" in tokenizer.convert_ids_to_tokens(ids) and "7" in tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.decode(tokenizer.encode("naïve ☃ 12")) == "naïve ☃ 12"
