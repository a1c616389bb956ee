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


def returns_huge(sample: RewardInput) -> float:
    return 1e39  # finite in Python, infinite as the float32 rewards are stored


def nan_from_step_2(sample: RewardInput) -> float:
    """A reward that breaks mid-run: steps 0 and 1 score, step 2 returns NaN (the dataset's order is the
    seeded cursor's, so the step is known from how many samples were scored)."""
    nan_from_step_2.calls = getattr(nan_from_step_2, "calls", 0) + 1
    return float("nan") if nan_from_step_2.calls > 16 else 0.5


def calls_exit(sample: RewardInput) -> float:
    import sys

    sys.exit(0)


def raises_base_exception(sample: RewardInput) -> float:
    raise BaseException("a plugin's own control flow")
