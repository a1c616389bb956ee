"""slime's rollout plugin contract, as slime calls it (THUDM/slime 624b824a: slime/rollout/sglang_rollout.py
`generate_and_rm`, `GenerateState`; slime/rollout/rm_hub/__init__.py; tests/plugin_contracts/): a user's custom
generate function and custom reward function, loaded by dotted path, checked the way slime's contract tests
check them, and called exactly as slime's `generate_and_rm` calls them, on a real `Sample` of the installed slime
(else of Miles, its fork with the same contract).

- generate: `async def generate(args, sample, sampling_params[, evaluation=False]) -> Sample | list[Sample]`; its
  first three parameters named so (test_plugin_generate_contracts.py `_assert_generate_signature`), awaited, with
  `evaluation=` passed only when a parameter of that name is declared (`**kwargs` does not count); a sample's own
  `generate_function_path` wins over the run's.
- reward: `async def rm(args, sample) -> float`, or under `--group-rm` `rm(args, samples) -> list[float]`
  (test_plugin_path_loading_contracts.py: parameters starting so); skipped for a sample whose generate function
  set `reward`; a returned list is scored in one batched call, and not at all when one of its samples is aborted.
- sampling_params: slime's dict (temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids,
  skip_special_tokens, `no_stop_trim`, `spaces_between_special_tokens`; `custom_params` asking for the top-p
  nucleus when top_p < 1), a copy per sample, and under deterministic inference `sampling_seed = rollout_seed +
  the sample's index in its group`.

- a step: every sample at once, at most slime's concurrency generating at a time (`run_groups`), the results in
  (group, index) order whatever order they finish in; under `--group-rm` each group scored in one call.
- what comes back: a Sample or a list of them (else refused before slime's code would read it), each held to what
  slime trains (`returned`: the types of slime's Sample, lengths aligned with response_length, trainable tokens
  with their log-probs, a real Status), in slime's own words where it has them; from a reward function called
  with several samples, a list of one reward each.

Miles (miles-rl 0.0.2) calls a function of this shape the same way (miles/rollout/inference_rollout/
compatibility.py `LegacyGenerateFnAdapter`: a function of three or more parameters whose first is not `input`);
its own newer shape, `generate(input: GenerateFnInput) -> GenerateFnOutput`, is refused here by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import numbers
from collections.abc import Callable
from typing import Any

from rlbench.core.plugins import load_function
from rlbench.core.vocab import valid_id
from rlbench.errors import BadInput

GENERATE_FIELD = "rollout.custom_generate_function_path"
REWARD_FIELD = "reward.custom_rm_path"
GENERATE_PARAMS = ("args", "sample", "sampling_params")  # test_plugin_generate_contracts.py
SOURCES = ("slime.utils.types", "miles.utils.types")  # the installed slime first, else Miles


def sample_class() -> type:
    """The `Sample` class plugins are handed: slime's where slime is importable, else Miles'."""
    import importlib

    for name in SOURCES:
        try:
            return importlib.import_module(name).Sample
        except ImportError:
            continue
    raise BadInput(
        "a slime plugin needs slime's Sample class, and neither slime nor Miles is importable here: install slime "
        "from its source (pip install -e <slime checkout> --no-deps), or put Miles' miles/ package on the path "
        "(python tests/get_miles.py unpacks it from the miles-rl wheel without installing the wheel; then "
        "PYTHONPATH=.vendor/miles-rl-0.0.2 rlbench run ...)",
        field=GENERATE_FIELD,
    )


def _names(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


def load_generate(path: str) -> Callable:
    """The custom generate function at `path`, held to slime's contract (BadInput naming the rule otherwise)."""
    fn = load_function(path, GENERATE_FIELD)
    names = _names(fn)
    if names[:1] == ["input"]:
        raise BadInput(
            f"{path} takes Miles' GenerateFnInput (generate(input)); slime's contract is "
            "generate(args, sample, sampling_params), which Miles also calls",
            field=GENERATE_FIELD,
        )
    if tuple(names[:3]) != GENERATE_PARAMS:
        raise BadInput(
            f"{path}'s parameters are ({', '.join(names)}): slime's contract starts them (args, sample, "
            "sampling_params) (tests/plugin_contracts/test_plugin_generate_contracts.py)",
            field=GENERATE_FIELD,
        )
    if not inspect.iscoroutinefunction(fn):
        raise BadInput(
            f"{path} is not an async function: slime awaits it (await fn(args, sample, sampling_params), "
            "slime/rollout/sglang_rollout.py generate_and_rm)",
            field=GENERATE_FIELD,
        )
    return fn


def load_reward(path: str, group: bool) -> Callable:
    """The custom reward function at `path`: `rm(args, sample)`, or `rm(args, samples)` under `--group-rm`."""
    fn = load_function(path, REWARD_FIELD)
    names, expected = _names(fn), ("args", "samples" if group else "sample")
    if tuple(names[:2]) != expected:
        mode = "with --group-rm" if group else "without --group-rm"
        raise BadInput(
            f"{path}'s parameters are ({', '.join(names)}): {mode} slime's contract starts them "
            f"({', '.join(expected)}) (tests/plugin_contracts/test_plugin_path_loading_contracts.py)",
            field=REWARD_FIELD,
        )
    if not inspect.iscoroutinefunction(fn):
        raise BadInput(
            f"{path} is not an async function: slime awaits it (slime/rollout/rm_hub/__init__.py async_rm)",
            field=REWARD_FIELD,
        )
    return fn


def sampling_params(
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    stop: list[str] | None,
    stop_token_ids: list[int] | None,
    skip_special_tokens: bool,
) -> dict[str, Any]:
    """slime's base sampling_params (GenerateState.__init__), from the run's rollout settings."""
    params = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "skip_special_tokens": skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    return params


def group_params(base: dict[str, Any], group_size: int, rollout_seed: int, deterministic: bool) -> list[dict]:
    """Each sample's own copy of `base` in a group of `group_size` (generate_and_rm_group): under deterministic
    inference with `sampling_seed = rollout_seed + its index in the group`, as slime sets it."""
    return [{**base, **({"sampling_seed": rollout_seed + i} if deterministic else {})} for i in range(group_size)]


async def call_generate(fn: Callable, args: Any, sample: Any, params: dict, evaluation: bool = False):
    """One call of a custom generate function as slime makes it: `evaluation=` only when the function declares
    a parameter of that name."""
    if "evaluation" in inspect.signature(fn).parameters:
        return await _plugin(fn, GENERATE_FIELD, fn(args, sample, params, evaluation=evaluation))
    return await _plugin(fn, GENERATE_FIELD, fn(args, sample, params))


async def _plugin(fn: Callable, field: str, call):
    """Await a plugin's coroutine; what it raises (but Ctrl-C and cancellation) becomes BadInput naming it."""
    try:
        return await call
    except (KeyboardInterrupt, asyncio.CancelledError, BadInput):
        raise
    except BaseException as exc:  # noqa: BLE001 - a plugin's bug, named, the cause kept for --debug
        raise BadInput(f"{_name(fn)} raised {exc.__class__.__name__}: {exc}", field=field) from exc


def _name(fn: Callable) -> str:
    """A plugin's dotted name. Every plugin came through load_generate or load_reward, which take only what
    inspect.iscoroutinefunction does (a function, or a method or functools.partial of one): each has __module__;
    a partial has no __qualname__, and is named by its repr."""
    return f"{fn.__module__}.{getattr(fn, '__qualname__', fn)}"


def _samples(result: Any, sample_cls: type, path: str) -> list:
    """What a generate function returned, as a list: a Sample or a non-empty list of them, else BadInput naming
    `path`."""
    samples = result if isinstance(result, list) else [result]
    if not samples or not all(isinstance(s, sample_cls) for s in samples):
        got = type(result).__name__ if not isinstance(result, list) else f"a list of {len(samples)} holding others"
        raise BadInput(
            f"{path} returned {got if samples else 'an empty list'}, expected a Sample or a list of Samples "
            "(slime/rollout/sglang_rollout.py generate_and_rm)",
            field=GENERATE_FIELD,
        )
    return samples


async def _rewards(fn: Callable, args: Any, samples: list) -> list:
    """One batched call of the reward function `fn` (batched_async_rm): a list of one reward per sample, else
    BadInput naming it (slime zips what came back onto the samples, leaving some unscored or failing there)."""
    values = await _plugin(fn, REWARD_FIELD, fn(args, samples))
    if not isinstance(values, list) or len(values) != len(samples):
        got = f"a list of {len(values)}" if isinstance(values, list) else type(values).__name__
        raise BadInput(
            f"{_name(fn)} returned {got}, expected a list of one reward per sample ({len(samples)}) "
            "(slime/rollout/rm_hub/__init__.py batched_async_rm)",
            field=REWARD_FIELD,
        )
    return values


async def generate_and_rm(
    args: Any,
    sample: Any,
    params: dict,
    generate: Callable,
    reward: Callable | None,
    group_rm: bool,
    evaluation: bool = False,
    load: Callable[[str], Callable] = load_generate,
    semaphore: asyncio.Semaphore | None = None,
):
    """slime's `generate_and_rm` for one sample: generate (the sample's own `generate_function_path` first, else
    `generate`; holding `semaphore` meanwhile, as slime holds GenerateState's, generation only), then the reward
    unless the function set it, the sample was aborted, or `group_rm` defers it to the group; a returned list is
    scored in one batched call of `reward`, not at all when one of its samples is aborted. `reward`: None where no
    reward plugin is named (the caller scores the samples itself)."""
    status = type(sample).Status
    if sample.status in (status.COMPLETED, status.TRUNCATED):
        return sample  # slime asserts a response (and a reward without --group-rm) and generates nothing
    own = getattr(sample, "generate_function_path", None)
    fn = load(own) if own else generate
    async with semaphore or contextlib.nullcontext():
        result = await call_generate(fn, args, sample, params, evaluation)
    _samples(result, type(sample), _name(fn))
    if group_rm or reward is None:
        return result
    if isinstance(result, list):
        if any(s.status == status.ABORTED for s in result):
            return result
        need = [s for s in result if s.reward is None]  # batched_async_rm: called even when `need` is empty
        for s, value in zip(need, await _rewards(reward, args, need)):
            s.reward = value
        return result
    if result.status != status.ABORTED and result.reward is None:
        result.reward = await _plugin(reward, REWARD_FIELD, reward(args, result))
    return result


async def run_groups(
    args: Any,
    groups: list[list],
    params: list[list[dict]],
    generate: Callable,
    reward: Callable | None,
    group_rm: bool,
    concurrency: int,
) -> list[list]:
    """A step's groups as slime's `generate_and_rm_group` runs them: every sample at once, at most `concurrency`
    generating at a time, then under `group_rm` each group scored in one call. Results come back in the order the
    groups and samples were given (asyncio.gather's), whatever order they finish in: a step's samples are ordered
    by (group, index), never by completion. `params[g][i]`: sample i of group g's sampling_params."""
    semaphore = asyncio.Semaphore(concurrency)

    async def group(samples: list, group_params: list[dict]) -> list:
        done = await asyncio.gather(
            *(
                generate_and_rm(args, s, p, generate, reward, group_rm, semaphore=semaphore)
                for s, p in zip(samples, group_params)
            )
        )
        if group_rm and reward is not None:
            if any(isinstance(d, list) for d in done):  # slime would set `reward` on a list and fail there
                raise BadInput(
                    "a generate function that returns lists (fan-out) cannot be scored by group (--group-rm): slime's "
                    "generate_and_rm_group sets each result's reward, and a list has none",
                    field=GENERATE_FIELD,
                )
            for sample, value in zip(done, await _rewards(reward, args, list(done))):
                sample.reward = value
        return list(done)

    return list(await asyncio.gather(*(group(g, p) for g, p in zip(groups, params))))


def plugin_args(config, router_ip: str, router_port: int, engines: int, rollout_seed: int, group_rm: bool = False):
    """slime's argument namespace as a plugin reads it (every `args.X` slime/rollout/sglang_rollout.py,
    rm_hub/__init__.py, utils/http_utils.py and slime's example generate functions read at 624b824a), valued from
    the run's config `config` (a RunConfig) where rlbench holds the setting, else at slime's parser's default; the
    engine's router at `router_ip:router_port` serving `engines` engines of one GPU each."""
    from argparse import Namespace

    rollout, data = config.rollout, config.data
    return Namespace(
        # the model and the data (slime/utils/arguments.py)
        hf_checkpoint=config.model.path,
        seed=config.seed,
        rollout_batch_size=data.prompts_per_step,
        over_sampling_batch_size=data.prompts_per_step,  # slime sets it to rollout_batch_size when absent
        n_samples_per_prompt=rollout.n_samples_per_prompt,
        apply_chat_template=data.apply_chat_template,
        apply_chat_template_kwargs=dict(data.chat_template_kwargs),
        rollout_global_dataset=True,
        multimodal_keys=None,
        # sampling (GenerateState's sampling_params)
        rollout_temperature=rollout.temperature,
        rollout_top_p=rollout.top_p,
        rollout_top_k=rollout.top_k,
        rollout_max_response_len=rollout.max_new_tokens,
        rollout_max_context_len=None,
        rollout_stop=None,
        rollout_stop_token_ids=list(rollout.stop_token_ids) or None,
        rollout_skip_special_tokens=False,
        rollout_seed=rollout_seed,
        sglang_enable_deterministic_inference=True,  # rlbench's runs are: each request's tokens fixed by its seed
        # plugins and rewards
        custom_generate_function_path=rollout.custom_generate_function_path,
        custom_rm_path=config.reward.custom_rm_path,
        group_rm=group_rm,
        rm_type=None,
        rm_url=None,
        reward_key=None,
        eval_reward_key=None,
        rollout_sample_hook_path=[],
        dynamic_sampling_filter_path=None,
        rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None,
        partial_rollout=False,
        mask_offpolicy_in_partial_rollout=False,
        use_rollout_routing_replay=False,
        max_tokens_per_gpu=None,
        eval_datasets=[],
        ci_test=False,
        # where the engine is (slime/backends/sglang_utils/arguments.py; http_utils.init_http_client)
        sglang_router_ip=router_ip,
        sglang_router_port=router_port,
        sglang_server_concurrency=512,
        sglang_dp_size=1,
        rollout_num_engines=engines,
        rollout_num_gpus=engines,
        rollout_num_gpus_per_engine=1,
        num_gpus_per_node=8,
        use_distributed_post=False,
    )


def returned(result: Any, sample_cls: type, path: str, vocab: int) -> list:
    """What a custom generate function returned, as a list of samples, each held to what slime's training reads
    (BadInput naming `path`, the sample and the rule, in slime's own words where slime has them: Sample's
    `_validate_response_metadata_lengths` and `append_response_tokens`)."""
    samples = _samples(result, sample_cls, path)
    for i, s in enumerate(samples):
        where = f"{path}: sample {i}" if len(samples) > 1 else path
        if not isinstance(s.status, sample_cls.Status):
            raise BadInput(f"{where}: status is {s.status!r}, expected a Sample.Status", field=GENERATE_FIELD)
        tokens, length = s.tokens, s.response_length
        if not isinstance(tokens, list) or not all(valid_id(t, vocab) for t in tokens):
            raise BadInput(f"{where}: tokens: expected a list of ids in [0, {vocab})", field=GENERATE_FIELD)
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= len(tokens):
            raise BadInput(
                f"{where}: response_length {length!r}: expected 0..{len(tokens)} (len(tokens))", field=GENERATE_FIELD
            )
        mask = [1] * length if s.loss_mask is None else s.loss_mask
        if not isinstance(mask, list) or any(m not in (0, 1) for m in mask):
            raise BadInput(f"{where}: loss_mask: expected 0s and 1s in a list, got {mask!r:.60}", field=GENERATE_FIELD)
        if len(mask) != length:
            raise BadInput(f"{where}: loss_mask length {len(mask)} != response_length {length}", field=GENERATE_FIELD)
        if not isinstance(s.response, str):
            raise BadInput(f"{where}: response: expected str, got {s.response!r:.60}", field=GENERATE_FIELD)
        logprobs = s.rollout_log_probs
        if logprobs is not None and not (isinstance(logprobs, list) and all(map(_number, logprobs))):
            raise BadInput(
                f"{where}: rollout_log_probs: expected a list of numbers, got {logprobs!r:.60}", field=GENERATE_FIELD
            )
        if logprobs is None and any(mask) and s.status != sample_cls.Status.ABORTED and not s.remove_sample:
            raise BadInput(
                f"{where}: trainable response tokens require rollout log probabilities.", field=GENERATE_FIELD
            )
        if logprobs is not None and len(logprobs) != length:
            raise BadInput(
                f"{where}: rollout_log_probs length {len(logprobs)} != response_length {length}", field=GENERATE_FIELD
            )
    return samples


def _number(value: Any) -> bool:
    """A number torch trains (slime's Sample.rollout_log_probs is list[float]): not a bool, not text."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
