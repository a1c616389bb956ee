"""Custom generate functions (`--custom-generate-function-path`): multi-turn and agentic rollouts.

A generate function produces one sample's trajectory from its prompt, using the engine turn by
turn: `fn(env: GenerateEnv, prompt: Prompt, prompt_ids: tuple[int, ...], seed: int) -> Trajectory`.
Everything after the prompt is the response span: sampled tokens (loss mask 1, with the engine's
log-probs) and environment tokens such as tool results (loss mask 0, log-prob 0). `turns` keeps,
per assistant turn, the ids the engine was given and the ids it sampled: `check tito` holds them
to the token-in-token-out rule. Loaded by `core/plugins.load_function`, held to its contract
here (tests/cpu/test_generate_plugin.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlbench.core.seeding import derive_seed
from rlbench.core.types import GenerateRequest, GenerateResult
from rlbench.errors import BadInput


@dataclass(frozen=True)
class GenerateEnv:
    engine: object
    tokenizer: object
    max_new_tokens: int
    temperature: float
    stop_token_ids: tuple[int, ...]
    top_k: int = -1
    top_p: float = 1.0

    def sample(self, prompt_ids: list[int] | tuple[int, ...], seed: int, turn: int) -> GenerateResult:
        """One assistant turn from the engine; the turn's seed is derived from the sample's."""
        request = GenerateRequest(
            tuple(prompt_ids),
            derive_seed(seed, "turn", turn),
            self.max_new_tokens,
            self.temperature,
            self.stop_token_ids,
            self.top_k,
            self.top_p,
        )
        return self.engine.generate([request])[0]


@dataclass
class Trajectory:
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    finish_reason: str
    answer: str  # what the verifier scores: the final assistant text
    messages: list[dict]  # the whole conversation, assistant turns as text
    turns: list[dict] = field(default_factory=list)  # [{"prompt_ids": [...], "output_ids": [...]}]
    engine_id: str = ""
    weight_version: int = 0
    prompt_ids: list[int] | None = None  # when the function renders its own prompt (with tools, say)


def check_trajectory(traj: object, name: str) -> Trajectory:
    """Hold a generate function's result to the contract; a violation names the function."""
    if not isinstance(traj, Trajectory):
        raise BadInput(f"returned {type(traj).__name__}, expected rlbench.core.generate.Trajectory", field=name)
    n = len(traj.response_ids)
    if len(traj.loss_mask) != n or len(traj.logprobs) != n:
        raise BadInput(
            f"response_ids, loss_mask and logprobs must have one length, got {n}, "
            f"{len(traj.loss_mask)}, {len(traj.logprobs)}",
            field=name,
        )
    if any(m not in (0, 1) for m in traj.loss_mask):
        raise BadInput("loss_mask holds values other than 0 and 1", field=name)
    if traj.finish_reason not in ("stop", "length", "abort"):
        raise BadInput(f"finish_reason {traj.finish_reason!r} is not stop, length or abort", field=name)
    return traj


def load_generate_fn(path: str) -> tuple[str, Callable]:
    from rlbench.core.plugins import load_function

    return path, load_function(path, "--custom-generate-function-path")
