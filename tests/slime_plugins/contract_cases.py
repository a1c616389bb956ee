"""Custom generate and reward functions in slime's shapes, right and wrong, for tests/cpu/test_slime_contract.py.
They need no engine: each records how it was called on the sample it was handed and returns it."""

from __future__ import annotations

import asyncio
import copy
import functools

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


async def miles_style_with_options(input, *, verbose=False):
    """Miles' own shape with an option after `input`: Miles calls any function whose first parameter is `input` with
    a GenerateFnInput (compatibility.py `_is_legacy_generate_fn`: `params[0] != "input"`), whatever follows."""
    return input


async def reward_with_options(args, sample, scale=1.0):
    """slime checks the first two parameters only (`tuple(parameters)[:2] == ("args", "sample")`): more after them,
    with defaults, are the user's own."""
    return 0.5 * scale


async def raises(args, sample, sampling_params):
    raise ValueError(f"no answer for sample {sample.index}")


async def raises_in_evaluation(args, sample, sampling_params, evaluation=False):
    raise ValueError(f"no answer for sample {sample.index}")


async def _raises_noted(args, sample, sampling_params, note=""):
    raise ValueError(note)


raises_partial = functools.partial(_raises_noted, note="from a partial")  # no __qualname__ of its own


async def reward_raises(args, sample):
    raise ZeroDivisionError("empty label")


async def group_reward_raises(args, samples):
    raise ZeroDivisionError("empty label")


async def records(args, sample, sampling_params, evaluation=False):
    """Records on `args` what it was handed (sample index, sampling params, evaluation) and how many samples were
    generating at once (yielding to the event loop in between, so the others run)."""
    args.in_flight += 1
    args.most_in_flight = max(args.most_in_flight, args.in_flight)
    for _ in range(3):
        await asyncio.sleep(0)
    args.in_flight -= 1
    args.seen.append(("generate", sample.index, dict(sampling_params), evaluation))
    sample.status = type(sample).Status.COMPLETED
    return sample


async def reward_records(args, sample):
    indices = [s.index for s in sample] if isinstance(sample, list) else sample.index
    args.seen.append(("reward", indices))
    return [0.5] * len(sample) if isinstance(sample, list) else 0.5


async def group_reward_records(args, samples):
    args.seen.append(("group_reward", [s.index for s in samples]))
    return [0.75] * len(samples)


async def returns_given(args, sample, sampling_params):
    """Returns what the test put in `args.given` (a generate function that returns what slime cannot use)."""
    sample.status = type(sample).Status.COMPLETED
    return args.given(sample) if callable(args.given) else args.given


async def reward_given(args, sample):
    """Returns `args.given`, whatever it was called with (a fan-out's list included)."""
    return args.given


async def group_reward_given(args, samples):
    return args.given
