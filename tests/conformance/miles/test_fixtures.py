"""The offline tokenizers with real chat templates are what build_tokenizers.py builds, byte for byte, and each says
where its template comes from: Miles' file (path, commit, blob: the same bytes as the installed package's), or the
model repository Miles names with the edit that undoes Miles' change, or a public copy."""

from __future__ import annotations

import json

from tests.conformance.miles import build_tokenizers as build
from tests.conformance.miles.common import TOKENIZERS


def test_a_rebuild_gives_the_committed_bytes():
    base = build.base_tokenizer()
    for name in build.TOKENIZERS:
        files, _ = build.build_one(name, base)
        for rel, text in files.items():
            assert (TOKENIZERS / rel).read_text(encoding="utf-8") == text, rel
    assert sorted(p.name for p in TOKENIZERS.iterdir() if p.is_dir()) == sorted(build.TOKENIZERS)


def test_every_template_says_where_it_comes_from():
    from miles_tito_tokenizers import TEMPLATE_DIR

    sources = json.loads((TOKENIZERS / "sources.json").read_text())
    assert len(sources["miles_commit"]) == 40 and set(sources["tokenizers"]) == set(build.TOKENIZERS)
    for name, source in sources["tokenizers"].items():
        assert source["model_repository"] and source["family"] in build.FAMILIES
        config = json.loads((TOKENIZERS / name / "tokenizer_config.json").read_text())
        if source["source"] is None:  # DeepSeek: an encoder, no template
            assert "chat_template" not in config and (TOKENIZERS / name / "config.json").is_file()
            continue
        if "miles" in source:
            assert (
                source["miles"]["path"].endswith(source["source"])
                and source["miles"]["commit"] == sources["miles_commit"]
            )
            fixed = (TEMPLATE_DIR / source["source"]).read_text(encoding="utf-8")
            assert (config["chat_template"] == fixed) is not source["original"]
        if source["original"]:
            assert "note" in source
