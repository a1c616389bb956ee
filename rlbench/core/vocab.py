"""A run's valid token ids: one definition for the engines, the SGLang client, the recording and every check.

A model has `model` logits (its config.json's vocab_size); its tokenizer has `tokenizer` ids (len(tokenizer)),
often fewer: Qwen3 has 151,936 rows and a tokenizer of 151,669 ids, the rest padding of the embedding and LM
head. The engine samples from all of the model's logits, as SGLang does, and the trainer's log-softmax
covers the same rows, so their log-probs stay comparable (masking the padded rows in the engine alone would
make its log-probs differ from the trainer's). So a run's valid ids are 0 <= id < model. The ids in
[tokenizer, model) are *padded ids*: valid, recorded and trained, but they decode to no text, so no text
re-tokenises to one. An id >= model in a recording is bad input.

A run's manifest records both sizes (its "vocab" section, `as_manifest`); `run_vocab` reads them back, and for
a run from before the section, the model's config.json (else the tokenizer: what such runs were held to).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlbench.errors import BadInput

if TYPE_CHECKING:  # annotations only: the SGLang wire and the CLI import this module without torch
    import torch

# The recording's tensors that hold token ids (recording.py names the layout).
ID_TENSORS = ("tokens", "top_p_ids")


def valid_id(token: object, model: int) -> bool:
    """Whether `token` is a token id of a model with `model` logits: an int (not a bool) in [0, model)."""
    return isinstance(token, int) and not isinstance(token, bool) and 0 <= token < model


def model_vocab(model_path: str | Path) -> int:
    """The model's vocabulary: its config.json's vocab_size, the logits the engine samples from."""
    from rlbench.core.model import load_model_config

    return int(load_model_config(model_path).vocab_size)


@dataclass(frozen=True)
class Vocab:
    """The model's vocabulary (`model` ids, all valid) and the tokenizer's (`tokenizer` ids, those that decode)."""

    model: int
    tokenizer: int

    def padded(self, token: int) -> bool:
        """A valid id the tokenizer cannot decode (a padded row of the embedding and LM head)."""
        return self.tokenizer <= token < self.model

    def count_padded(self, ids: Iterable[int]) -> int:
        return sum(1 for t in ids if self.tokenizer <= t < self.model)

    def check(self, tensors: dict[str, torch.Tensor], path: Path) -> None:
        """Every id of a step's recording (read from `path`) is valid, else BadInput naming the file and tensor."""
        for key in ID_TENSORS:
            ids = tensors.get(key)
            if ids is not None and ids.numel() and int(ids.max()) >= self.model:
                raise BadInput(
                    f"token id {int(ids.max())} is outside the model's vocabulary ({self.model} ids; "
                    f"the tokenizer has {self.tokenizer})",
                    path=path,
                    field=key,
                )

    def text(self, tok, ids: list[int]) -> str:
        """`ids` as text with the tokenizer `tok` (their ids as a list without one); each padded id shown as
        `<padded id N>`, which no decode gives."""
        if tok is None:
            return str(list(ids))
        parts, run = [], []
        for token in ids:
            if self.padded(token):
                parts += [tok.decode(run)] * bool(run) + [f"<padded id {token}>"]
                run = []
            else:
                run.append(token)
        return "".join(parts + [tok.decode(run)] * bool(run))

    def as_manifest(self) -> dict[str, int]:
        return {"model": self.model, "tokenizer": self.tokenizer}


def run_vocab(manifest: dict, path: Path, tokenizer=None) -> Vocab | None:
    """The vocabulary of the run whose manifest (read from `path`) is `manifest`: its "vocab" section, held to
    its type; for a run from before the section, the model's config.json and `tokenizer`, or the tokenizer
    alone where the model's config cannot be read. None: neither is known (no check can be made)."""
    section = manifest.get("vocab")
    if section is not None:
        model, tok = section.get("model"), section.get("tokenizer")
        for field, value in (("vocab.model", model), ("vocab.tokenizer", tok)):
            if not valid_id(value, 2**31) or value < 1:
                raise BadInput(f"expected an integer in [1, 2**31 - 1], got {value!r}", path=path, field=field)
        if tok > model:
            raise BadInput(f"expected at most vocab.model ({model}) ids, got {tok}", path=path, field="vocab.tokenizer")
        return Vocab(model, tok)
    size = len(tokenizer) if tokenizer is not None else None
    model_dir = ((manifest.get("config") or {}).get("model") or {}).get("path")
    try:
        model = model_vocab(model_dir) if isinstance(model_dir, str) else size
    except BadInput:
        model = size
    if model is None:
        return None
    return Vocab(model, min(size if size is not None else model, model))
