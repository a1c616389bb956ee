"""Build small offline tokenizers that carry real chat templates, the originals and the fixed versions Miles ships.

    python tests/conformance/miles/build_tokenizers.py MILES_REPO [--out DIR]   (default: tokenizers/ beside this file)

MILES_REPO is a checkout of radixark/miles (a bare git directory will do): its commit is recorded, and each fixed
template is checked to be the very file at miles/utils/chat_template_utils/templates/ there. The templates are read
from the installed miles-tito-tokenizers package (0.1.1 ships the same files).

No model hub is reachable here, so the vocabularies are not the models': each tokenizer is a byte-level BPE (the full
256-byte alphabet, so any text encodes) trained on the conversation texts the tests play, with the family's chat
markup as added tokens, marked special or not as noted in `FAMILIES`. What a chat template renders, and which ids are
special, is what the TITO checks depend on; the ids themselves are arbitrary.

Where each template comes from is written to sources.json:
- fixed: Miles' file, path and commit, and the kwargs Miles registers for it (FixedTemplateRow).
- original, Qwen3 / Qwen3-2507 / Qwen3.5 / Kimi K2.5 / MiniMax-M2.5: the model repository Miles names for it; the
  text is Miles' fixed file with Miles' change undone (the reasoning gate that `clear_thinking` / `preserve_thinking`
  switches, `ORIGINAL_EDITS` below). For Qwen3 that is character for character the template of the Qwen3 model cards
  as a public copy shows it; for the others it is a reconstruction of the part Miles changed, said so in the file.
- GLM-4.7: Miles registers no fixed file (the model's own template with `clear_thinking: false`); templates/
  glm47_flash.jinja is the GLM-4.7-Flash template from a public copy (not checked against the hub).
- DeepSeek V3.2 / V4: no chat template; a config.json with the model_type Miles' encoders detect.

Every file is written from sorted JSON, so a rebuild gives the same bytes (test_fixtures_rebuild checks that).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 400
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MILES_TEMPLATES = "miles/utils/chat_template_utils/templates"

_QWEN = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
# family: added tokens (content, special), eos, pad, the stop tokens of generation_config.json, the model repository
# Miles names, and Miles' TITO family. Special flags follow the model repositories as far as Miles' code shows them
# (Kimi: every marker special, <|im_middle|> too; DeepSeek: <｜User｜>/<｜Assistant｜> are not), else an assumption.
FAMILIES = {
    "qwen3": dict(tokens=_QWEN, eos="<|im_end|>", pad="<|endoftext|>", stops=["<|im_end|>", "<|endoftext|>"]),
    "qwen35": dict(
        tokens=_QWEN
        + [("<|vision_start|>", True), ("<|vision_end|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True)],
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stops=["<|im_end|>", "<|endoftext|>"],
    ),
    "glm47": dict(
        tokens=[
            ("<|endoftext|>", True),
            ("[MASK]", True),
            ("[gMASK]", True),
            ("[sMASK]", True),
            ("<sop>", True),
            ("<eop>", True),
            ("<|system|>", True),
            ("<|user|>", True),
            ("<|assistant|>", True),
            ("<|observation|>", True),
            ("<think>", False),
            ("</think>", False),
            ("<tool_call>", False),
            ("</tool_call>", False),
            ("<tool_response>", False),
            ("</tool_response>", False),
            ("<arg_key>", False),
            ("</arg_key>", False),
            ("<arg_value>", False),
            ("</arg_value>", False),
        ],
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        stops=["<|endoftext|>", "<|user|>", "<|observation|>"],
    ),
    "kimi25": dict(
        tokens=[
            ("[BOS]", True),
            ("[EOS]", True),
            ("<|im_end|>", True),
            ("<|im_user|>", True),
            ("<|im_assistant|>", True),
            ("<|im_system|>", True),
            ("<|im_middle|>", True),
            ("<|tool_calls_section_begin|>", True),
            ("<|tool_calls_section_end|>", True),
            ("<|tool_call_begin|>", True),
            ("<|tool_call_argument_begin|>", True),
            ("<|tool_call_end|>", True),
            ("<think>", True),
            ("</think>", True),
        ],
        eos="[EOS]",
        pad="[EOS]",
        stops=["<|im_end|>"],
    ),
    "minimax_m25": dict(
        tokens=[
            ("]~!b[", True),
            ("]~b]", True),
            ("[e~[", True),
            ("<think>", False),
            ("</think>", False),
            ("<minimax:tool_call>", False),
            ("</minimax:tool_call>", False),
        ],
        eos="[e~[",
        pad="[e~[",
        stops=["[e~["],
    ),
    "deepseek": dict(
        tokens=[
            ("<｜begin▁of▁sentence｜>", True),
            ("<｜end▁of▁sentence｜>", True),
            ("<｜User｜>", False),
            ("<｜Assistant｜>", False),
            ("<think>", False),
            ("</think>", False),
        ],
        eos="<｜end▁of▁sentence｜>",
        pad="<｜end▁of▁sentence｜>",
        stops=["<｜end▁of▁sentence｜>"],
    ),
}

# The originals: Miles' fixed file with Miles' change undone, each edit (old, new) applied exactly once.
_QWEN3_KEPT = """        {%- if (not (clear_thinking | default(true))) or loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}"""
_QWEN3_ORIGINAL = """        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}"""
_QWEN35_LOOP_END = """            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
"""
ORIGINAL_EDITS = {
    "qwen3_fixed.jinja": [(_QWEN3_KEPT, _QWEN3_ORIGINAL)],
    "qwen3_thinking_2507_and_next_fixed.jinja": [(_QWEN3_KEPT, _QWEN3_ORIGINAL)],
    "qwen3.5_fixed.jinja": [
        (
            "{%- if (not (clear_thinking | default(true))) or loop.index0 > ns.last_query_index %}",
            "{%- if loop.index0 > ns.last_query_index %}",
        ),
        (
            _QWEN35_LOOP_END,
            _QWEN35_LOOP_END + "{%- if ns.multi_step_tool %}\n"
            "    {{- raise_exception('No user query found in messages.') }}\n"
            "{%- endif %}\n",
        ),
    ],
    "kimi_k25_fixed.jinja": [
        (
            "{%- set preserve_thinking = preserve_thinking | default(false) -%}\n"
            "{# Find last non-tool-call assistant message. If preserve_thinking, keep -1 so hist is empty and all msgs use "
            "suffix (retain reasoning). #}\n",
            "{# Find last non-tool-call assisitant message #}\n",
        ),
        ("{%- if not preserve_thinking -%}\n{%- for idx", "{%- for idx"),
        ("{%- endfor -%}\n{%- endif -%}\n\n{# split", "{%- endfor -%}\n\n{# split"),
    ],
    "minimax_m25_fixed.jinja": [
        (
            "{#- Only render reasoning_content if no user message follows (or clear_thinking disabled) -#}",
            "{#- Only render reasoning_content if no user message follows -#}",
        ),
        (
            "reasoning_content and (not (clear_thinking | default(true)) or loop.index0 > ns.last_user_index)",
            "reasoning_content and loop.index0 > ns.last_user_index",
        ),
    ],
}

# name: (family, Miles' fixed file or a file here, whether it is the original, model repository Miles names)
TOKENIZERS = {
    "qwen3": ("qwen3", "qwen3_fixed.jinja", True, "Qwen/Qwen3-4B"),
    "qwen3-fixed": ("qwen3", "qwen3_fixed.jinja", False, "Qwen/Qwen3-4B"),
    "qwen3-2507": ("qwen3", "qwen3_thinking_2507_and_next_fixed.jinja", True, "Qwen/Qwen3-4B-Thinking-2507"),
    "qwen3-2507-fixed": ("qwen3", "qwen3_thinking_2507_and_next_fixed.jinja", False, "Qwen/Qwen3-4B-Thinking-2507"),
    "qwen35": ("qwen35", "qwen3.5_fixed.jinja", True, "Qwen/Qwen3.5-0.8B"),
    "qwen35-fixed": ("qwen35", "qwen3.5_fixed.jinja", False, "Qwen/Qwen3.5-0.8B"),
    "glm47": ("glm47", "templates/glm47_flash.jinja", True, "zai-org/GLM-4.7-Flash"),
    "kimi25": ("kimi25", "kimi_k25_fixed.jinja", True, "moonshotai/Kimi-K2.5"),
    "kimi25-fixed": ("kimi25", "kimi_k25_fixed.jinja", False, "moonshotai/Kimi-K2.5"),
    "minimax-m25": ("minimax_m25", "minimax_m25_fixed.jinja", True, "MiniMaxAI/MiniMax-M2.5"),
    "minimax-m25-fixed": ("minimax_m25", "minimax_m25_fixed.jinja", False, "MiniMaxAI/MiniMax-M2.5"),
    "deepseek-v32": ("deepseek", None, True, "deepseek-ai/DeepSeek-V3.2"),
    "deepseek-v4": ("deepseek", None, True, "deepseek-ai/DeepSeek-V4"),
}
DEEPSEEK_MODEL_TYPE = {"deepseek-v32": "deepseek_v32", "deepseek-v4": "deepseek_v4"}


def corpus() -> list[str]:
    """The texts the tokenizers are trained on: the conversations rlbench's audit and Miles' mock trajectories play."""
    from miles_tito_tokenizers.testing import mock_trajectories

    from rlbench.checks.tito_shapes import conversation_shapes

    lines = []
    for messages, _ in conversation_shapes().values():
        lines += [json.dumps(m, sort_keys=True) for m in messages]
    for name in sorted(dir(mock_trajectories)):
        cls = getattr(mock_trajectories, name)
        if isinstance(cls, type) and hasattr(cls, "MESSAGES"):
            lines += [json.dumps(m, sort_keys=True) for m in cls.MESSAGES]
            lines.append(json.dumps(cls.TOOLS, sort_keys=True))
    return lines + ["user", "assistant", "system", "tool", "You are a helpful assistant."]


def base_tokenizer() -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok.to_str()


def template_text(source: str, original: bool) -> str:
    if source.startswith("templates/"):
        return (HERE / source).read_text(encoding="utf-8")
    from miles_tito_tokenizers import TEMPLATE_DIR

    text = (Path(TEMPLATE_DIR) / source).read_text(encoding="utf-8")
    for old, new in ORIGINAL_EDITS[source] if original else []:
        assert text.count(old) == 1, (source, old[:60])
        text = text.replace(old, new)
    return text


def _dump(obj, indent: int | None = 1) -> str:
    return json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False) + "\n"


def build_one(name: str, base: str) -> tuple[dict[str, str], dict]:
    from tokenizers import AddedToken, Tokenizer

    family, source, original, model = TOKENIZERS[name]
    spec = FAMILIES[family]
    tok = Tokenizer.from_str(base)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in spec["tokens"]])
    vocab = tok.get_vocab(with_added_tokens=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": spec["eos"],
        "pad_token": spec["pad"],
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    files = {}
    if source is not None:
        config["chat_template"] = template_text(source, original)
    else:
        files[f"{name}/config.json"] = _dump({"model_type": DEEPSEEK_MODEL_TYPE[name]})
    files[f"{name}/tokenizer.json"] = _dump(json.loads(tok.to_str()), indent=None)  # one line: half the bytes
    files[f"{name}/tokenizer_config.json"] = _dump(config)
    files[f"{name}/generation_config.json"] = _dump({"eos_token_id": [vocab[t] for t in spec["stops"]]})
    return files, {
        "family": family,
        "model_repository": model,
        "original": original,
        "source": source,
        "stop_tokens": spec["stops"],
        "added_tokens": [[t, s] for t, s in spec["tokens"]],
    }


def miles_commit(repo: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def check_against_miles(repo: Path, source: str) -> str:
    """The blob id of Miles' own file; the packaged file must be the same bytes."""
    from miles_tito_tokenizers import TEMPLATE_DIR

    blob = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", f"HEAD:{MILES_TEMPLATES}/{source}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    data = (Path(TEMPLATE_DIR) / source).read_bytes()
    mine = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert mine == blob, f"{source}: the packaged template is not Miles' file at HEAD"
    return blob


def build(repo: Path, out: Path) -> list[Path]:
    import miles_tito_tokenizers
    from importlib.metadata import version

    base = base_tokenizer()
    commit = miles_commit(repo)
    files, sources = {}, {}
    for name in TOKENIZERS:
        made, source = build_one(name, base)
        files.update(made)
        if source["source"] and not source["source"].startswith("templates/"):
            source["miles"] = {
                "repository": "radixark/miles",
                "commit": commit,
                "path": f"{MILES_TEMPLATES}/{source['source']}",
                "blob": check_against_miles(repo, source["source"]),
                "package": f"miles-tito-tokenizers {version('miles-tito-tokenizers')}",
            }
            if source["original"]:
                source["note"] = (
                    "reconstructed: Miles' fixed file with Miles' change undone (build_tokenizers.py "
                    "ORIGINAL_EDITS)" + (", the Qwen3 model cards' template" if name == "qwen3" else "")
                )
        elif source["source"]:
            source["note"] = "the model's own template, from a public copy, not checked against the model repository"
        sources[name] = source
    files["sources.json"] = _dump(
        {"miles_commit": commit, "package": miles_tito_tokenizers.__name__, "tokenizers": sources}
    )
    return _fixtures_build().write_files(out, files)


def _fixtures_build():
    """rlbench/fixtures/build.py (a script beside the fixtures, not a module of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fixtures_build", Path(__file__).resolve().parents[3] / "rlbench/fixtures/build.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("miles_repo", type=Path)
    parser.add_argument("--out", type=Path, default=HERE / "tokenizers")
    args = parser.parse_args()
    for path in build(args.miles_repo, args.out):
        print(path)


if __name__ == "__main__":
    main()
