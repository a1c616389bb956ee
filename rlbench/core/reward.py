"""The `reward` stage: verifiers that score a response against the dataset label.

Built-in verifiers are looked up by name; any other function comes by dotted path
(`--custom-rm-path`) and has the same contract: `fn(sample: RewardInput) -> float`, a finite
number. A verifier that raises or returns anything else stops the run with its name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rlbench.core.plugins import call_plugin, load_function
from rlbench.errors import BadInput


@dataclass(frozen=True)
class RewardInput:
    """What a verifier sees of one sample."""

    messages: tuple[dict, ...]
    response: str
    label: str
    finish_reason: str
    metadata: dict = field(default_factory=dict)


_PARITY = re.compile(r"even|odd", re.IGNORECASE)


def parity(sample: RewardInput) -> float:
    """1.0 when the first 'even' or 'odd' in the response is the label, else 0.0.

    Deliberately lenient, as math verifiers that extract a final answer are: the answer is the
    first occurrence, wherever it stands. A random policy gets signal from it (the default run from
    random weights learned the task this way); the strict variant below gives a random policy no signal at all.
    """
    found = _PARITY.search(sample.response)
    return 1.0 if found and found.group(0).lower() == sample.label.lower() else 0.0


def exact_match(sample: RewardInput) -> float:
    """1.0 when the stripped response equals the stripped label, else 0.0."""
    return 1.0 if sample.response.strip() == sample.label.strip() else 0.0


BUILTIN: dict[str, Callable[[RewardInput], float]] = {"parity": parity, "exact_match": exact_match}


def load_reward_fn(verifier: str, custom_rm_path: str | None) -> tuple[str, Callable[[RewardInput], float]]:
    """The verifier to use and its name: the custom function if given, else a built-in by name."""
    if custom_rm_path:
        return custom_rm_path, load_function(custom_rm_path, "--custom-rm-path")
    if verifier not in BUILTIN:
        raise BadInput(
            f"unknown verifier {verifier!r} (built-in: {', '.join(BUILTIN)}; or give --custom-rm-path)",
            field="reward.verifier",
        )
    return verifier, BUILTIN[verifier]


FLOAT32_MAX = 3.4028234663852886e38  # rewards are stored and trained as float32


def score(name: str, fn: Callable[[RewardInput], float], sample: RewardInput) -> float:
    """Call a verifier and hold it to its contract (a finite real number, finite as float32 too)."""
    value = call_plugin(fn, "reward function", name, sample)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or abs(value) > FLOAT32_MAX
    ):
        raise BadInput(
            f"reward function returned {value!r}; expected a finite number (within float32's range)", field=name
        )
    return float(value)
