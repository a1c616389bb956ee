"""The token-in-token-out builders `check tito --audit` plays, and what they share with the other lenses.

A builder keeps the token buffer of a conversation: the ids the engine was given and sampled. When the conversation
grows after an assistant turn (a tool result, a user message), the builder appends ids for the new messages and the
next generation prompt, without re-encoding the buffer:

- plain (rlbench's own, `--tito-model` not given): the template's rendering of the grown conversation must extend
  its rendering of the history; the builder appends the text it adds, encoded. It knows no model: a newline the
  template renders after the end-of-turn the model stopped at is lost (mode 2), a stop token that is also the next
  turn's opener is doubled (mode 3).
- a Miles family (`--tito-model qwen3`, ...): Miles' builder for that model (tito_miles.py), which renders each
  appended segment against dummy messages and applies the family's merge rule (the newline after <|im_end|> that
  Qwen, Nemotron and MiniMax put back, GLM's trim of a sampled <|user|> / <|observation|>), with the template kwargs
  and append roles Miles registers.

Both render with the same kwargs as the rest of the audit: the user's, and for a family Miles' registered ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rlbench.checks.tito import encode, render
from rlbench.errors import BadInput


class BuildError(Exception):
    """The builder cannot extend the buffer for this conversation (its message says why)."""


class PrefixBroken(BuildError):
    """The template's rendering of the grown conversation does not extend its rendering of the history."""


class PlainBuilder:
    name = "plain"
    family = None
    roles = None  # any role may be appended

    def __init__(self, tok, kwargs: dict):
        self.tok, self.kwargs = tok, dict(kwargs)

    def render(self, messages: list[dict], tools, generation: bool) -> str:
        return render(self.tok, messages, tools, generation, self.kwargs)

    def extend(self, old: list[dict], new: list[dict], buffer: list[int], tools) -> list[int]:
        history, grown = self.render(old, tools, False), self.render(new, tools, True)
        if not grown.startswith(history):
            raise PrefixBroken("the template's rendering of the longer conversation does not extend the history")
        return list(buffer) + encode(self.tok, grown[len(history) :])


class FamilyBuilder:
    """Miles' builder for a model family (it raises ValueError where it cannot merge: that is a finding)."""

    def __init__(self, tok, name: str, kwargs: dict, roles: list[str] | None):
        from rlbench.checks.tito_miles import load_family

        self.tok = tok
        self.family = load_family(tok, name, kwargs, roles)
        self.name, self.kwargs, self.roles = name, self.family.kwargs, self.family.roles

    def render(self, messages: list[dict], tools, generation: bool) -> str:
        from rlbench.checks.tito_miles import render as miles_render

        return miles_render(self.family, messages, tools, generation)

    def extend(self, old: list[dict], new: list[dict], buffer: list[int], tools) -> list[int]:
        try:
            return list(self.family.tito.merge_tokens(old, new, list(buffer), tools=tools))
        except ValueError as exc:
            raise BuildError(" ".join(str(exc).split())[:300]) from None


def make_builder(tok, family: str | None, kwargs: dict, roles: list[str] | None):
    if family is None:
        if roles:
            raise BadInput(
                "append roles are what a Miles family's builder allows: give --tito-model too",
                field="--tito-allowed-append-roles",
            )
        return PlainBuilder(tok, kwargs)
    return FamilyBuilder(tok, family, kwargs, roles)


def template_errors() -> tuple[type[Exception], ...]:
    """What a chat template (or Miles' rendering around it, or a DeepSeek encoder) raises on a conversation it
    cannot render: a finding for that conversation, never an internal error."""
    from jinja2 import TemplateError

    errors: tuple[type[Exception], ...] = (
        TemplateError,
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        IndexError,
        AssertionError,
    )
    try:
        from miles_tito_tokenizers.encoders.deepseek_v32 import DS32EncodingError
    except ImportError:  # pragma: no cover - a core dependency
        return errors
    return errors + (DS32EncodingError,)


def assistant_start(tok, builder) -> str | None:
    """What opens an assistant turn (for Miles' assistant / non-assistant text categories): the generation prompt's
    first special token and the role name after it ("<|im_start|>assistant", "<|assistant|>", "]~b]ai")."""
    try:
        probe = [{"role": "user", "content": "x"}]
        prompt = builder.render(probe, None, True)[len(builder.render(probe, None, False)) :]
    except template_errors():
        return None
    specials = sorted((t.content for t in tok.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    at = min(((prompt.find(s), s) for s in specials if s in prompt), default=None)
    if at is None:
        return None
    start, token = at
    name = re.match(r"[^\n<]*", prompt[start + len(token) :]).group(0)
    return token + name


def stop_ids(tok, tokenizer_dir: str | Path | None) -> frozenset[int]:
    """The ids that end a sampled turn: the tokenizer's end-of-turn and generation_config.json's eos_token_id (an
    id or a list of them), where the directory has one (GLM lists <|user|> and <|observation|>)."""
    stops = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    path = Path(tokenizer_dir) / "generation_config.json" if tokenizer_dir is not None else None
    if path is None or not path.is_file():
        return frozenset(stops)
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, AttributeError):
        raise BadInput("expected a JSON object", path=path) from None
    listed = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tok) for i in listed):
        raise BadInput(f"eos_token_id: expected ids of this tokenizer (0..{len(tok) - 1}), got {value!r}", path=path)
    return frozenset(stops | set(listed))
