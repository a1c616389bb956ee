"""What the Miles conformance tests share: the offline tokenizers with real chat templates (build_tokenizers.py),
and trajectories played the way a TITO pipeline, a naive re-render and a skip-special decode build their ids."""

from __future__ import annotations

from copy import deepcopy
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENIZERS = HERE / "tokenizers"

# tokenizer: (Miles' family, append roles) that Miles verifies its fixed template (or kwargs) with; and the original
FIXED = {
    "qwen3-fixed": ("qwen3", ["tool", "user"]),
    "qwen3-2507-fixed": ("qwennext", ["tool", "user"]),
    "qwen35-fixed": ("qwen35", ["tool", "user"]),
    "glm47": ("glm47", ["tool", "user"]),
    "minimax-m25-fixed": ("minimax_m25", ["tool", "user"]),
    "kimi25-fixed": ("kimi25", ["tool", "user"]),
}
# original: (the fixed one it goes with, kwargs that undo a kwargs-only fix: GLM-4.7's own template, as shipped)
ORIGINAL = {
    "qwen3": ("qwen3-fixed", {}),
    "qwen3-2507": ("qwen3-2507-fixed", {}),
    "qwen35": ("qwen35-fixed", {}),
    "glm47": ("glm47", {"clear_thinking": True}),
    "minimax-m25": ("minimax-m25-fixed", {}),
    "kimi25": ("kimi25-fixed", {}),
}


@cache
def tokenizer(name: str):
    from rlbench.core.model import load_tokenizer

    return load_tokenizer(TOKENIZERS / name)


def trajectory_classes(roles: set[str]) -> list[type]:
    """Miles' mock trajectories whose appended roles the builder allows."""
    from miles_tito_tokenizers.testing import chat_template_verify

    return [c for c in chat_template_verify._TRAJECTORIES if c.APPEND_ROLES <= roles]


def stops(name: str) -> frozenset[int]:
    from rlbench.checks.tito_builders import stop_ids

    return stop_ids(tokenizer(name), TOKENIZERS / name)


def play(tok, tito, cls, stop: frozenset[int], skip_special: bool = False) -> dict:
    """A JSONL row of one of Miles' mock trajectories, built as Miles' TITO builder `tito` builds it: each turn
    sampled as the template renders it after the generation prompt (with its reasoning where the template leaves it
    out, as the audit plays it), up to its stop token; with `skip_special`, each turn's ids decoded with
    skip_special_tokens=True and encoded again first, as a naive pipeline does."""
    from rlbench.checks.tito import decode, encode
    from rlbench.checks.tito_reasoning import with_reasoning

    messages, tools = deepcopy(cls.MESSAGES), cls.TOOLS
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    messages = messages[: turns[-1] + 1]
    buffer = encode(tok, tito.render_messages(messages[: turns[0]], add_generation_prompt=True, tools=tools))
    sampled = []
    for k, j in enumerate(turns):
        prompt = tito.render_messages(messages[:j], add_generation_prompt=True, tools=tools)
        turn = tito.render_messages(messages[: j + 1], add_generation_prompt=False, tools=tools)
        assert turn.startswith(prompt), cls.__name__
        body, _ = with_reasoning(turn[len(prompt) :], messages[j], prompt)  # what a model that reasoned sampled
        ids = encode(tok, body)
        at = next((i for i, t in enumerate(ids) if t in stop), None)
        if at is None:  # GLM: the stop is the next message's opener
            following = tito.render_messages(messages[: j + 2], add_generation_prompt=False, tools=tools)
            ids = ids + encode(tok, following[len(turn) :])[:1] if k + 1 < len(turns) else ids + [tok.eos_token_id]
        else:
            ids = ids[: at + 1]
        sampled.append(ids)
        buffer = buffer + (encode(tok, decode(tok, ids, skip_special_tokens=True)) if skip_special else ids)
        if k + 1 < len(turns):
            buffer = tito.merge_tokens(messages[: j + 1], messages[: turns[k + 1]], buffer, tools=tools)
    return {
        "messages": messages,
        "tools": tools,
        "token_ids": buffer,
        "sampled": sampled,
        "chat_template_kwargs": dict(tito.chat_template_kwargs),
    }


def naive(tok, tito, cls, stop: frozenset[int]) -> dict:
    """The same trajectory as a naive pipeline trains on it: the chat template's re-render of its messages."""
    from rlbench.checks.tito import encode

    row = play(tok, tito, cls, stop)
    text = tito.render_messages(row["messages"], add_generation_prompt=False, tools=row["tools"])
    return {**row, "token_ids": encode(tok, text)}
