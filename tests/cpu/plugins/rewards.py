"""Reward functions used by the plugin contract tests."""

from rlbench.core.reward import RewardInput

NOT_CALLABLE = 3


def constant_half(sample: RewardInput) -> float:
    return 0.5


def response_length(sample: RewardInput) -> float:
    return float(len(sample.response))


def returns_nan(sample: RewardInput) -> float:
    return float("nan")


def returns_text(sample: RewardInput):
    return "1.0"


def raises(sample: RewardInput) -> float:
    raise KeyError("label")
