"""The records that flow between stages: prompts, engine requests and results, samples.

Field names follow slime's `Sample` (slime/utils/types.py) where one exists, so dumps and
recordings line up: group_index, index, tokens, response, response_length, label, reward,
loss_mask, rollout_log_probs, status.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_TO_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}


@dataclass(frozen=True)
class Prompt:
    """One dataset row: its index in the dataset, its chat messages and its label."""

    index: int
    messages: tuple[dict, ...]
    label: str | None  # None: the dataset has no labels (data.label_key unset)
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateRequest:
    """What a rollout engine is asked for one sample (SGLang: one /generate with input_ids)."""

    prompt_ids: tuple[int, ...]
    seed: int  # SGLang: sampling_params.sampling_seed
    max_new_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...]
    top_k: int = -1  # SGLang's meaning: -1 (or 0) keeps every token
    top_p: float = 1.0  # 1.0 keeps every token


@dataclass(frozen=True)
class GenerateResult:
    """What the engine returned: sampled ids, their log-probs, and why generation ended."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" | "length" | "abort"
    engine_id: str
    weight_version: int


@dataclass
class Sample:
    """One trajectory of a step. `tokens` is prompt + response; `loss_mask` and `rollout_log_probs`
    are aligned with the response (slime's invariant: equal lengths, = response_length)."""

    group_index: int
    index: int
    prompt: Prompt
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response: str
    rollout_log_probs: tuple[float, ...]
    loss_mask: tuple[int, ...]
    finish_reason: str
    seed: int
    engine_id: str
    weight_version: int
    reward: float | None = None
    extra: dict = field(default_factory=dict)  # a generate function's: full messages, per-turn ids

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def status(self) -> str:
        return FINISH_TO_STATUS.get(self.finish_reason, "failed")

    def metadata(self) -> dict[str, Any]:
        """The JSON half of the recording for this sample."""
        return {
            "index": self.index,
            "group_index": self.group_index,
            "prompt_index": self.prompt.index,
            "messages": list(self.prompt.messages),
            "label": self.prompt.label,
            "response": self.response,
            "response_length": self.response_length,
            "finish_reason": self.finish_reason,
            "status": self.status,
            "seed": self.seed,
            "engine_id": self.engine_id,
            "weight_version": self.weight_version,
            "reward": self.reward,
            **self.extra,
        }
