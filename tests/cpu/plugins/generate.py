"""Generate functions used by the plugin contract tests."""

from rlbench.core.generate import Trajectory


def wrong_lengths(env, prompt, prompt_ids, seed):
    return Trajectory([1, 2, 3], [1, 1], [0.0, 0.0, 0.0], "stop", "odd", list(prompt.messages))


def not_a_trajectory(env, prompt, prompt_ids, seed):
    return {"response_ids": []}
