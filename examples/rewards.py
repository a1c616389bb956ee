"""An example reward function for `--custom-rm-path examples.rewards.brief_parity`.

The contract (rlbench/core/reward.py): `fn(sample: RewardInput) -> float`, a finite number.
"""

from rlbench.core.reward import RewardInput, parity


def brief_parity(sample: RewardInput) -> float:
    """The parity verifier, minus a little for every character past the one-word answer."""
    extra = max(0, len(sample.response.strip()) - len(sample.label))
    return parity(sample) - 0.01 * extra
