"""The `data` stage: a validated JSONL prompt dataset and a seeded, resumable cursor over it.

Each line is `{"prompt": str | [messages], "label": str, ...}` (keys configurable); extra keys
are kept as metadata. The cursor is a pure function of (seed, step): step s takes positions
[s*k, (s+1)*k) of an endless stream of epochs, each epoch a permutation drawn from
`derive_seed(master, "data", epoch)`. So resuming at step s needs no saved RNG state.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from rlbench.core.seeding import derive_seed
from rlbench.core.types import Prompt
from rlbench.errors import BadInput

_ROLES = {"system", "user", "assistant", "tool"}
MAX_LINE = 1_000_000  # characters: far beyond any prompt a model of this kind takes (checked in tokens later)


def _messages(value: object, path: Path, lineno: int, key: str) -> tuple[dict, ...]:
    if isinstance(value, str):
        return ({"role": "user", "content": value},)
    if isinstance(value, list) and value:
        for i, msg in enumerate(value):
            if not (isinstance(msg, dict) and msg.get("role") in _ROLES and isinstance(msg.get("content"), str)):
                raise BadInput(
                    f"line {lineno}: field '{key}[{i}]': expected a message "
                    '{"role": system|user|assistant|tool, "content": str}',
                    path=path,
                )
        return tuple(dict(m) for m in value)
    raise BadInput(
        f"line {lineno}: field '{key}': expected a string or a non-empty list of messages, got {type(value).__name__}",
        path=path,
    )


def load_dataset(path: str | Path, prompt_key: str = "prompt", label_key: str | None = "label") -> list[Prompt]:
    """Read and validate every line; the first bad one raises BadInput with its line number. Without a
    `label_key` the rows carry no label (a custom reward function scores them)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput("dataset not found", path=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read dataset ({exc.__class__.__name__})", path=path) from None
    prompts: list[Prompt] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE:
            raise BadInput(
                f"line {lineno}: {len(line):,} characters, more than a prompt may hold ({MAX_LINE:,})", path=path
            )
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"line {lineno}: invalid JSON ({exc.msg} at column {exc.colno})", path=path) from None
        except RecursionError:
            raise BadInput(f"line {lineno}: invalid JSON: nested too deeply", path=path) from None
        try:  # JSON may escape a lone surrogate, which no tokenizer can encode
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadInput(
                f"line {lineno}: holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is no text", path=path
            ) from None
        if not isinstance(row, dict):
            raise BadInput(f"line {lineno}: expected a JSON object, got {type(row).__name__}", path=path)
        if prompt_key not in row:
            raise BadInput(f"line {lineno}: field '{prompt_key}' missing", path=path)
        label = row.get(label_key) if label_key is not None else None
        if label_key is not None and not isinstance(label, str):
            raise BadInput(
                f"line {lineno}: field '{label_key}': expected a string, got "
                f"{'nothing' if label is None else type(label).__name__}",
                path=path,
            )
        meta = {k: v for k, v in row.items() if k not in (prompt_key, label_key)}
        prompts.append(Prompt(len(prompts), _messages(row[prompt_key], path, lineno, prompt_key), label, meta))
    if not prompts:
        raise BadInput("dataset is empty", path=path)
    return prompts


class PromptCursor:
    """Which dataset rows step s uses: a pure function of (seed, step), so resume is exact."""

    def __init__(self, size: int, seed: int, per_step: int, shuffle: bool = True):
        self.size, self.seed, self.per_step, self.shuffle = size, seed, per_step, shuffle
        self._epochs: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            if self.shuffle:
                rng = np.random.default_rng(derive_seed(self.seed, "data", epoch))
                self._epochs = {epoch: rng.permutation(self.size)}  # keep one epoch: memory stays flat
            else:
                self._epochs = {epoch: np.arange(self.size)}
        return self._epochs[epoch]

    def indices(self, step: int) -> list[int]:
        start = step * self.per_step
        return [int(self._order(pos // self.size)[pos % self.size]) for pos in range(start, start + self.per_step)]

    def state(self, step: int) -> dict:
        """The cursor's position after `step` steps, for checkpoints and the manifest."""
        consumed = step * self.per_step
        return {
            "consumed": consumed,
            "epoch": consumed // self.size,
            "offset": consumed % self.size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }


def encode_prompts(
    tokenizer, dataset: list[Prompt], limit: int = 1 << 30, source: str = "", template_kwargs: dict | None = None
) -> dict[int, tuple[int, ...]]:
    """Each prompt tokenised once, up front: rendered by the chat template with a generation prompt
    (and `template_kwargs`), or, with `template_kwargs` None (no chat template), a string prompt's text
    as it is, without special tokens, as slime tokenises it. One that leaves no room for the response
    in the model's context (`limit` tokens) is bad input."""
    encoded = {}
    with _quiet_tokenizer():  # once for the whole dataset: setting transformers' verbosity walks its loggers
        for prompt in dataset:
            ids = _encode(tokenizer, prompt, source, template_kwargs)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            if not ids:  # an engine has nothing to continue from (a chat template that renders nothing)
                raise BadInput(f"prompt {prompt.index} renders to no tokens", path=source)
            if len(ids) > limit:
                raise BadInput(
                    f"prompt {prompt.index} renders to {len(ids)} tokens; with the response it must fit the "
                    f"model's {limit} + max_new_tokens positions",
                    path=source,
                )
            encoded[prompt.index] = tuple(int(t) for t in ids)
    return encoded


def _encode(tokenizer, prompt: Prompt, source: str, template_kwargs: dict | None):
    """One prompt's ids (see `encode_prompts`); a chat template that fails to render is bad input naming
    the tokenizer: the template is the tokenizer's own program (a Jinja syntax error, an unknown filter,
    its own raise_exception, an error in what it computes)."""
    if template_kwargs is None:
        if len(prompt.messages) != 1 or prompt.messages[0].get("role") != "user":
            raise BadInput(
                f"prompt {prompt.index} is a list of messages: without the chat template "
                "(data.apply_chat_template false) a prompt is a string",
                path=source,
            )
        return tokenizer(prompt.messages[0]["content"], add_special_tokens=False)["input_ids"]
    try:
        return tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, tokenize=True, **template_kwargs
        )
    except Exception as exc:  # noqa: BLE001 - whatever the template's code raises, it is the tokenizer's
        first = (str(exc).splitlines() or [""])[0][:160]
        raise BadInput(
            f"the chat template cannot render prompt {prompt.index} ({exc.__class__.__name__}: {first})",
            path=getattr(tokenizer, "name_or_path", None) or None,
            field="chat_template",
        ) from None


@contextmanager
def _quiet_tokenizer():
    """transformers warns (on stderr, once) when a prompt is longer than the tokenizer's model_max_length;
    rlbench holds each prompt to the model's positions itself (`encode_prompts`), in one line."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
