"""Custom generate and reward functions in slime's shapes, right and wrong, for tests/cpu/test_slime_contract.py.
They need no engine: each records how it was called on the sample it was handed and returns it."""

from __future__ import annotations

import copy

CALLS: list[tuple] = []


async def generate(args, sample, sampling_params):
    """slime's documented shape (docs/en/get_started/customization.md): no `evaluation`."""
    CALLS.append(("generate", sample.index, dict(sampling_params)))
    sample.response, sample.status = "odd", type(sample).Status.COMPLETED
    return sample


async def generate_with_evaluation(args, sample, sampling_params, evaluation=False):
    """The multi-agent example's shape: `evaluation` declared, so slime passes it."""
    CALLS.append(("generate_with_evaluation", sample.index, evaluation))
    sample.status = type(sample).Status.COMPLETED
    return sample


async def generate_with_kwargs(args, sample, sampling_params, **kwargs):
    """`**kwargs` is not a parameter named `evaluation`: slime passes nothing to it."""
    CALLS.append(("generate_with_kwargs", sample.index, dict(kwargs)))
    sample.status = type(sample).Status.COMPLETED
    return sample


async def generate_sets_reward(args, sample, sampling_params):
    """A multi-turn environment that scores its own trajectory: the reward function is skipped for it."""
    sample.status, sample.reward = type(sample).Status.COMPLETED, 0.25
    return sample


async def fan_out(args, sample, sampling_params):
    """Two agents' samples from one prompt (the multi-agent example): the first scored in place, the second not."""
    first, second = copy.deepcopy(sample), copy.deepcopy(sample)
    first.status = second.status = type(sample).Status.COMPLETED
    first.reward = 1.0
    return [first, second]


async def fan_out_one_aborted(args, sample, sampling_params):
    """A fan-out whose second sample was aborted: slime scores none of the list."""
    first, second = copy.deepcopy(sample), copy.deepcopy(sample)
    first.status, second.status = type(sample).Status.COMPLETED, type(sample).Status.ABORTED
    return [first, second]


async def aborts(args, sample, sampling_params):
    sample.status = type(sample).Status.ABORTED
    return sample


def not_async(args, sample, sampling_params):
    return sample


async def wrong_names(args, prompt, params):
    return prompt


async def miles_style(input):
    return input


async def reward(args, sample):
    """A reward of one sample. slime's list branch calls the custom reward with a list even without --group-rm
    (rm_hub batched_async_rm: `custom_rm_path` set, one call with the samples), so a reward for fan-out plugins
    takes both."""
    if isinstance(sample, list):
        CALLS.append(("reward", [s.index for s in sample]))
        return [0.5] * len(sample)
    CALLS.append(("reward", sample.index))
    return 0.5


async def group_reward(args, samples):
    CALLS.append(("group_reward", [s.index for s in samples]))
    return [0.75] * len(samples)


def sync_reward(args, sample):
    return 0.0


async def finishes_in_given_order(args, sample, sampling_params):
    """Finishes when the sample before it in `args.finish_order` has (an event each, no clock), records that it
    finished, and answers with its own index: a test sets an order other than the samples' own."""
    await args.gates[sample.index].wait()
    args.finished.append(sample.index)
    position = args.finish_order.index(sample.index)
    if position + 1 < len(args.finish_order):
        args.gates[args.finish_order[position + 1]].set()
    sample.response, sample.status = f"answer {sample.index}", type(sample).Status.COMPLETED
    sample.tokens, sample.response_length = [sample.index], 1
    return sample
