"""slime's plugin contract (rlbench/core/slime_contract.py) on a real Sample (Miles', miles-rl 0.0.2): each rule
held by a test naming where slime states it (THUDM/slime 624b824a)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from rlbench.core import slime_contract as sc
from rlbench.errors import BadInput
from tests.slime_plugins import contract_cases as cases

CASES = "tests.slime_plugins.contract_cases"
# the options a user sets, which every refusal names (the CLI prints the field, then the rule)
GENERATE_OPTION, REWARD_OPTION = "rollout.custom_generate_function_path", "reward.custom_rm_path"


@pytest.fixture
def Sample(miles):
    cases.CALLS.clear()
    return sc.sample_class()


def _run(sample, generate, reward=None, group_rm=False, evaluation=False, params=None):
    fn = sc.load_generate(f"{CASES}.{generate}")
    rm = None if reward is None else sc.load_reward(f"{CASES}.{reward}", group_rm)
    return asyncio.run(sc.generate_and_rm(None, sample, params or {}, fn, rm, group_rm, evaluation))


def test_the_sample_is_miles_where_slime_is_absent(Sample):
    assert Sample.__module__ == "miles.utils.types" and Sample.Status.ABORTED.value == "aborted"


def test_without_slime_or_miles_one_line_says_what_to_install(monkeypatch):
    """The whole line: both ways to get a Sample class, each a command that works from this repository."""
    for name in sc.SOURCES:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    with pytest.raises(BadInput) as err:
        sc.sample_class()
    assert err.value.field == GENERATE_OPTION and str(err.value) == (
        f"{GENERATE_OPTION}: a slime plugin needs slime's Sample class, and neither slime nor Miles is importable "
        "here: install slime from its source (pip install -e <slime checkout> --no-deps), or put Miles' miles/ "
        "package on the path (python tests/get_miles.py unpacks it from the miles-rl wheel without installing the "
        "wheel; then PYTHONPATH=.vendor/miles-rl-0.0.2 rlbench run ...)"
    )


MILES_SHAPE = (
    " takes Miles' GenerateFnInput (generate(input)); slime's contract is generate(args, sample, sampling_params), "
    "which Miles also calls"
)


@pytest.mark.parametrize(
    "name, rule",
    [
        (
            "not_async",
            " is not an async function: slime awaits it (await fn(args, sample, sampling_params), "
            "slime/rollout/sglang_rollout.py generate_and_rm)",
        ),
        (
            "wrong_names",
            "'s parameters are (args, prompt, params): slime's contract starts them (args, sample, sampling_params) "
            "(tests/plugin_contracts/test_plugin_generate_contracts.py)",
        ),
        ("miles_style", MILES_SHAPE),
        ("miles_style_with_options", MILES_SHAPE),  # Miles: a first parameter `input` is its shape, whatever follows
    ],
)
def test_a_generate_function_off_the_contract_is_refused_by_rule(Sample, name, rule):
    """test_plugin_generate_contracts.py `_assert_generate_signature`: the first three parameters are (args, sample,
    sampling_params); sglang_rollout.py generate_and_rm awaits the function. One line: the option, the function,
    the rule and where slime states it."""
    path = f"{CASES}.{name}"
    with pytest.raises(BadInput) as err:
        sc.load_generate(path)
    assert err.value.field == GENERATE_OPTION and str(err.value) == f"{GENERATE_OPTION}: {path}{rule}"


def test_a_plugin_path_that_does_not_import_names_the_option_it_came_from(Sample):
    """A typo in --custom-generate-function-path or --custom-rm-path is reported against that option."""
    for load, option in ((sc.load_generate, GENERATE_OPTION), (lambda p: sc.load_reward(p, False), REWARD_OPTION)):
        with pytest.raises(BadInput, match="cannot import module 'tests.slime_plugins.no_such_module'") as err:
            load("tests.slime_plugins.no_such_module.fn")
        assert err.value.field == option


def test_reward_functions_by_mode(Sample):
    """test_plugin_path_loading_contracts.py `test_custom_rm_path_aligns_with_expected_format`: (args, sample), or
    (args, samples) with --group-rm, the first two parameters only; rm_hub awaits them. Each refusal one line: the
    option, the function, the mode and the rule."""
    sc.load_reward(f"{CASES}.reward", group=False)
    sc.load_reward(f"{CASES}.group_reward", group=True)
    sc.load_reward(f"{CASES}.reward_with_options", group=False)  # `[:2]`: parameters after the two are the user's
    contract = "(tests/plugin_contracts/test_plugin_path_loading_contracts.py)"
    refusals = [
        (
            "reward",
            True,
            "'s parameters are (args, sample): with --group-rm slime's contract starts them (args, samples)",
        ),
        (
            "group_reward",
            False,
            "'s parameters are (args, samples): without --group-rm slime's contract starts them (args, sample)",
        ),
    ]
    for name, group, rule in refusals:
        with pytest.raises(BadInput) as err:
            sc.load_reward(f"{CASES}.{name}", group=group)
        assert err.value.field == REWARD_OPTION
        assert str(err.value) == f"{REWARD_OPTION}: {CASES}.{name}{rule} {contract}"
    with pytest.raises(BadInput) as err:
        sc.load_reward(f"{CASES}.sync_reward", group=False)
    assert err.value.field == REWARD_OPTION and str(err.value) == (
        f"{REWARD_OPTION}: {CASES}.sync_reward is not an async function: slime awaits it "
        "(slime/rollout/rm_hub/__init__.py async_rm)"
    )


def test_evaluation_is_passed_only_to_a_parameter_of_that_name(Sample):
    """sglang_rollout.py generate_and_rm: `if "evaluation" in inspect.signature(fn).parameters`."""
    _run(Sample(index=1), "generate_with_evaluation", evaluation=True)
    _run(Sample(index=2), "generate_with_kwargs", evaluation=True)
    assert cases.CALLS == [("generate_with_evaluation", 1, True), ("generate_with_kwargs", 2, {})]


def test_a_samples_own_generate_function_wins(Sample):
    """test_generate_and_rm_prefers_per_sample_generate_function."""
    sample = Sample(index=3, generate_function_path=f"{CASES}.generate_with_evaluation")
    _run(sample, "generate")
    assert [c[0] for c in cases.CALLS] == ["generate_with_evaluation"]


def test_rewards_as_slime_gives_them(Sample):
    """generate_and_rm: the reward function for a sample without one; skipped where the generate function set it or
    aborted the sample; --group-rm leaves it to the group."""
    assert _run(Sample(index=4), "generate", "reward").reward == 0.5
    assert _run(Sample(index=5), "generate_sets_reward", "reward").reward == 0.25
    assert _run(Sample(index=6), "aborts", "reward").reward is None
    assert _run(Sample(index=7), "generate", "group_reward", group_rm=True).reward is None
    assert cases.CALLS[-1][0] == "generate" and ("reward", 4) in cases.CALLS and ("reward", 5) not in cases.CALLS


def test_a_fan_out_is_scored_in_one_batched_call_unless_one_is_aborted(Sample):
    """generate_and_rm's list branch: `batched_async_rm` over the samples without a reward (custom_rm_path: one call
    with the list); any aborted sample: the list comes back unscored."""
    out = _run(Sample(index=8), "fan_out", "reward")
    assert [s.reward for s in out] == [1.0, 0.5] and cases.CALLS == [("reward", [8])]
    out = _run(Sample(index=9), "fan_out_one_aborted", "reward")
    assert [s.reward for s in out] == [None, None] and cases.CALLS == [("reward", [8])]


def test_a_sample_class_without_per_sample_generate_functions_uses_the_runs(Sample):
    """sglang_rollout.py reads `getattr(sample, "generate_function_path", None)`: a slime whose Sample predates the
    field (a plain class here, with slime's Status) is generated by the run's function, as slime would."""

    class SampleWithoutThePath:
        Status = Sample.Status

        def __init__(self, index):
            self.index, self.status, self.reward = index, Sample.Status.PENDING, None

    out = _run(SampleWithoutThePath(11), "generate", "reward")
    assert (out.response, out.reward) == ("odd", 0.5) and cases.CALLS == [("generate", 11, {}), ("reward", 11)]


@pytest.mark.parametrize(
    "generate, reward, option, raised",
    [
        ("raises", None, GENERATE_OPTION, f"{CASES}.raises raised ValueError: no answer for sample 12"),
        (
            "raises_in_evaluation",
            None,
            GENERATE_OPTION,
            f"{CASES}.raises_in_evaluation raised ValueError: no answer for sample 12",
        ),
        ("generate", "reward_raises", REWARD_OPTION, f"{CASES}.reward_raises raised ZeroDivisionError: empty label"),
        ("fan_out", "reward_raises", REWARD_OPTION, f"{CASES}.reward_raises raised ZeroDivisionError: empty label"),
    ],
)
def test_what_a_plugin_raises_becomes_one_line_naming_the_plugin_and_its_option(
    Sample, generate, reward, option, raised
):
    """A plugin's bug is the user's to fix (exit 2): the option, the function by its dotted path, the exception's
    class and message, the exception kept as the cause; generate functions with and without `evaluation`, the
    reward of one sample and of a fan-out's list."""
    with pytest.raises(BadInput) as err:
        _run(Sample(index=12), generate, reward, evaluation=True)
    assert err.value.field == option and str(err.value) == f"{option}: {raised}"
    assert isinstance(err.value.__cause__, (ValueError, ZeroDivisionError))


def test_a_plugin_given_as_a_partial_is_named_by_the_function_it_wraps(Sample):
    """functools.partial has no __qualname__: the error names it by its repr, which names the wrapped function."""
    with pytest.raises(BadInput, match=r"_raises_noted at .* raised ValueError: from a partial$") as err:
        _run(Sample(index=13), "raises_partial")
    assert err.value.field == GENERATE_OPTION


def test_call_generate_outside_evaluation_tells_the_function_so(Sample):
    """A training rollout: `evaluation=False` to a function that declares it, and the args and sampling_params given."""
    from types import SimpleNamespace

    args = SimpleNamespace(seen=[], in_flight=0, most_in_flight=0)
    fn = sc.load_generate(f"{CASES}.records")
    asyncio.run(sc.call_generate(fn, args, Sample(index=14), {"sampling_seed": 3}))
    assert args.seen == [("generate", 14, {"sampling_seed": 3}, False)]


def test_a_finished_sample_is_not_generated_again(Sample):
    sample = Sample(index=10, response="even", reward=1.0, status=Sample.Status.COMPLETED)
    assert _run(sample, "generate", "reward") is sample and cases.CALLS == []


def test_sampling_params_as_generate_state_builds_them():
    """GenerateState.__init__ and generate_and_rm_group: slime's keys, the nucleus asked for when top_p < 1, a copy
    per sample, `sampling_seed = rollout_seed + index in group` under deterministic inference."""
    base = sc.sampling_params(0.8, 0.9, -1, 16, None, [2], False)
    assert base == {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": -1,
        "max_new_tokens": 16,
        "stop": None,
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "custom_params": {"return_top_p_token_ids": True},
    }
    assert "custom_params" not in sc.sampling_params(1.0, 1.0, -1, 16, None, None, False)
    group = sc.group_params(base, 3, 42, deterministic=True)
    assert [p["sampling_seed"] for p in group] == [42, 43, 44] and group[0] is not group[1]
    assert all("sampling_seed" not in p for p in sc.group_params(base, 3, 42, deterministic=False))


# Every args.X slime's rollout code, rm_hub, http_utils and its example generate functions read (624b824a).
READ_BY_SLIME = """hf_checkpoint rollout_temperature rollout_top_p rollout_top_k rollout_max_context_len
rollout_max_response_len rollout_skip_special_tokens rollout_stop rollout_stop_token_ids rollout_seed
over_sampling_batch_size dynamic_sampling_filter_path partial_rollout mask_offpolicy_in_partial_rollout
custom_generate_function_path rollout_sample_hook_path rollout_global_dataset apply_chat_template
apply_chat_template_kwargs multimodal_keys rollout_batch_size n_samples_per_prompt max_tokens_per_gpu
use_rollout_routing_replay use_distributed_post rm_type reward_key eval_reward_key group_rm rm_url custom_rm_path
rollout_sample_filter_path rollout_all_samples_process_path ci_test rollout_num_gpus rollout_num_gpus_per_engine
num_gpus_per_node rollout_num_engines sglang_router_ip sglang_router_port sglang_server_concurrency sglang_dp_size
sglang_enable_deterministic_inference eval_datasets""".split()


def test_the_plugin_args_hold_every_field_slime_reads_valued_from_the_run():
    from rlbench.config import load_config

    config = load_config(
        rollout__temperature=0.7, rollout__top_p=0.9, rollout__max_new_tokens=12, rollout__stop_token_ids=(5,)
    )
    args = sc.plugin_args(config, "127.0.0.1", 30000, engines=2, rollout_seed=42)
    assert [name for name in READ_BY_SLIME if not hasattr(args, name)] == []
    assert (args.rollout_temperature, args.rollout_top_p, args.rollout_max_response_len) == (0.7, 0.9, 12)
    assert args.rollout_stop_token_ids == [5] and args.hf_checkpoint == config.model.path
    assert (args.rollout_batch_size, args.n_samples_per_prompt) == (
        config.data.prompts_per_step,
        config.rollout.n_samples_per_prompt,
    )
    assert (args.sglang_router_ip, args.sglang_router_port, args.rollout_num_engines) == ("127.0.0.1", 30000, 2)
    base = sc.sampling_params(
        args.rollout_temperature,
        args.rollout_top_p,
        args.rollout_top_k,
        args.rollout_max_response_len,
        args.rollout_stop,
        args.rollout_stop_token_ids,
        args.rollout_skip_special_tokens,
    )
    assert base["max_new_tokens"] == 12 and base["custom_params"] == {"return_top_p_token_ids": True}


def test_a_plugin_sees_slimes_argument_names_with_the_runs_values_else_slimes_defaults():
    """Every field: the run's setting where rlbench holds it, else slime's parser default (slime/utils/arguments.py
    and slime/backends/sglang_utils/arguments.py at 624b824a, cited per line), the engine where the run serves it;
    `--group-rm` off unless asked."""
    from rlbench.config import load_config

    generate, rm = f"{CASES}.generate", f"{CASES}.reward"
    config = load_config(
        seed=7,
        rollout__temperature=0.7,
        rollout__top_p=0.9,
        rollout__top_k=20,
        rollout__max_new_tokens=12,
        rollout__stop_token_ids=(5, 6),
        rollout__n_samples_per_prompt=3,
        data__prompts_per_step=4,
        train__minibatches=4,  # a divisor of the step's 12 samples (the default 8 is not); no plugin argument
        data__apply_chat_template=True,
        data__chat_template_kwargs={"enable_thinking": False},
        rollout__custom_generate_function_path=generate,
        reward__custom_rm_path=rm,
    )
    args = sc.plugin_args(config, "10.0.0.2", 30001, engines=2, rollout_seed=42)
    assert vars(args) == {
        # the run's settings
        "hf_checkpoint": config.model.path,
        "seed": 7,
        "rollout_batch_size": 4,
        "over_sampling_batch_size": 4,  # slime: rollout_batch_size when not given
        "n_samples_per_prompt": 3,
        "apply_chat_template": True,
        "apply_chat_template_kwargs": {"enable_thinking": False},
        "rollout_temperature": 0.7,
        "rollout_top_p": 0.9,
        "rollout_top_k": 20,
        "rollout_max_response_len": 12,
        "rollout_stop_token_ids": [5, 6],  # nargs="+": a list
        "rollout_seed": 42,
        "custom_generate_function_path": generate,
        "custom_rm_path": rm,
        "group_rm": False,  # store_true
        # rlbench's runs are deterministic: each request's tokens fixed by its seed (sglang's default is off)
        "sglang_enable_deterministic_inference": True,
        # slime's parser defaults
        "rollout_global_dataset": True,  # --disable-rollout-global-dataset, store_false
        "multimodal_keys": None,
        "rollout_max_context_len": None,
        "rollout_stop": None,
        "rollout_skip_special_tokens": False,  # store_true
        "rm_type": None,
        "rm_url": None,
        "reward_key": None,
        "eval_reward_key": None,
        "rollout_sample_hook_path": [],  # action="append", default=[]
        "dynamic_sampling_filter_path": None,
        "rollout_sample_filter_path": None,
        "rollout_all_samples_process_path": None,
        "partial_rollout": False,
        "mask_offpolicy_in_partial_rollout": False,
        "use_rollout_routing_replay": False,
        "max_tokens_per_gpu": None,
        "eval_datasets": [],  # _resolve_eval_datasets without --eval-config or --eval-prompt-data
        "ci_test": False,
        "sglang_server_concurrency": 512,
        "sglang_dp_size": 1,  # sglang's --dp-size, under slime's --sglang- prefix
        "rollout_num_gpus_per_engine": 1,
        "num_gpus_per_node": 8,
        "use_distributed_post": False,
        # where the engine is: 2 engines of one GPU each behind the router
        "sglang_router_ip": "10.0.0.2",
        "sglang_router_port": 30001,
        "rollout_num_engines": 2,
        "rollout_num_gpus": 2,
    }
    assert sc.plugin_args(config, "10.0.0.2", 30001, 2, 42, group_rm=True).group_rm is True


def _returned(Sample, result):
    return sc.returned(result, Sample, "my.generate", vocab=100)


def test_a_returned_sample_is_held_to_what_slime_trains(Sample):
    """A retool-like sample (model tokens trainable with their log-probs, tool output masked 0 with 0.0) passes;
    each break of slime's invariants is refused naming the plugin, the sample and the rule, in slime's words
    (types.py `_validate_response_metadata_lengths`, `append_response_tokens`)."""
    done = Sample.Status.COMPLETED

    def sample(**changes):
        fields = dict(
            tokens=[1, 2, 3, 4, 5, 6],
            response_length=4,
            loss_mask=[1, 0, 0, 1],
            rollout_log_probs=[-0.5, 0.0, 0.0, -1.25],
            status=done,
        )
        return Sample(**{**fields, **changes})

    good = sample()
    assert _returned(Sample, good) == [good] and _returned(Sample, [good, sample()]) == [good, sample()]
    assert _returned(Sample, sample(loss_mask=None, rollout_log_probs=[0.0] * 4))  # None: every token trains
    assert _returned(Sample, sample(rollout_log_probs=None, status=Sample.Status.ABORTED))  # not trained
    # response_length runs 0..len(tokens), both ends: an empty response, and a sample that is all response
    empty = sample(response_length=0, loss_mask=[], rollout_log_probs=[], status=Sample.Status.ABORTED)
    assert _returned(Sample, empty) == [empty]
    whole = sample(response_length=6, loss_mask=[1] * 6, rollout_log_probs=[-0.5] * 6)
    assert _returned(Sample, whole) == [whole]
    refusals = [
        ("not a sample", "returned str, expected a Sample or a list of Samples"),
        ([good, "x"], "returned a list of 2 holding others"),
        (sample(rollout_log_probs=None), "trainable response tokens require rollout log probabilities."),
        (sample(loss_mask=[1, 0]), "loss_mask length 2 != response_length 4"),
        (sample(rollout_log_probs=[-0.5]), "rollout_log_probs length 1 != response_length 4"),
        (sample(status="completed"), "status is 'completed', expected a Sample.Status"),
        (sample(tokens=[1, 2, 3, 4, 5, 100]), r"tokens: expected a list of ids in \[0, 100\)"),
        (sample(response_length=7), r"response_length 7: expected 0..6"),
        (sample(response_length=True), r"response_length True: expected 0..6"),  # a bool is no length
        ([good, sample(loss_mask=[1, 2, 0, 1])], "my.generate: sample 1: loss_mask: expected 0s and 1s"),
    ]
    for result, rule in refusals:
        with pytest.raises(BadInput, match=rule) as err:
            _returned(Sample, result)
        assert err.value.field == sc.GENERATE_FIELD and "my.generate" in str(err.value)


def test_a_refusal_of_what_came_back_says_where_in_one_line(Sample):
    """The plugin alone for a single sample, the plugin and the sample's position in a list; what is not a Sample
    named against slime's generate_and_rm, which expects one."""
    bad = Sample(tokens=[1, 2], response_length=1, status="completed")
    good = Sample(tokens=[1, 2], response_length=1, rollout_log_probs=[-0.5], status=Sample.Status.COMPLETED)
    expected = [
        (bad, "my.generate: status is 'completed', expected a Sample.Status"),
        ([good, bad], "my.generate: sample 1: status is 'completed', expected a Sample.Status"),
        (
            3,
            "my.generate returned int, expected a Sample or a list of Samples (slime/rollout/sglang_rollout.py "
            "generate_and_rm)",
        ),
    ]
    for result, line in expected:
        with pytest.raises(BadInput) as err:
            _returned(Sample, result)
        assert str(err.value) == f"{GENERATE_OPTION}: {line}"


def _groups_in_order(Sample, finish_order: list[int], concurrency: int, group_rm: bool = False):
    from types import SimpleNamespace

    async def go():
        args = SimpleNamespace(finish_order=finish_order, finished=[], gates={i: asyncio.Event() for i in range(6)})
        args.gates[finish_order[0]].set()
        groups = [[Sample(group_index=g, index=3 * g + i) for i in range(3)] for g in range(2)]
        generate = sc.load_generate(f"{CASES}.finishes_in_given_order")
        rm = sc.load_reward(f"{CASES}.group_reward" if group_rm else f"{CASES}.reward", group_rm)
        out = await sc.run_groups(args, groups, [[{}] * 3] * 2, generate, rm, group_rm, concurrency)
        return out, args.finished

    return asyncio.run(go())


def test_a_steps_samples_come_back_by_group_and_index_whatever_order_they_finish_in(Sample):
    """generate_and_rm_group's asyncio.gather: the results in the order given. Completion orders are forced by
    events (no clock): the reverse of the samples' order with every sample in flight, their own order one at a
    time; both give the same step."""
    reverse, one_by_one = _groups_in_order(Sample, [5, 4, 3, 2, 1, 0], 64), _groups_in_order(Sample, list(range(6)), 1)
    assert reverse[1] == [5, 4, 3, 2, 1, 0] and one_by_one[1] == [0, 1, 2, 3, 4, 5]
    for out, _ in (reverse, one_by_one):
        assert [[(s.index, s.response, s.reward) for s in g] for g in out] == [
            [(i, f"answer {i}", 0.5) for i in range(3)],
            [(i, f"answer {i}", 0.5) for i in range(3, 6)],
        ]


def test_group_rm_scores_each_group_in_one_call_and_refuses_a_fan_out(Sample):
    out, _ = _groups_in_order(Sample, list(range(6)), 2, group_rm=True)
    assert [s.reward for g in out for s in g] == [0.75] * 6
    assert ("group_reward", [0, 1, 2]) in cases.CALLS and ("group_reward", [3, 4, 5]) in cases.CALLS

    async def fan():
        groups = [[Sample(group_index=0, index=0)]]
        return await sc.run_groups(
            None,
            groups,
            [[{}]],
            sc.load_generate(f"{CASES}.fan_out"),
            sc.load_reward(f"{CASES}.group_reward", True),
            True,
            4,
        )

    with pytest.raises(BadInput) as err:
        asyncio.run(fan())
    assert err.value.field == GENERATE_OPTION and str(err.value) == (
        f"{GENERATE_OPTION}: a generate function that returns lists (fan-out) cannot be scored by group "
        "(--group-rm): slime's generate_and_rm_group sets each result's reward, and a list has none"
    )


def _step(
    Sample, generate: str, reward: str | None, group_rm: bool, concurrency: int = 64, groups: int = 2, given=None
):
    """run_groups over `groups` groups of 3 fresh samples (index 3g + i), sample i of group g given sampling_params
    {"sampling_seed": 100 + 3g + i}, with `args` a namespace the recording plugins write to (and `given`, what the
    *_given plugins return)."""
    from types import SimpleNamespace

    args = SimpleNamespace(seen=[], in_flight=0, most_in_flight=0, given=given)
    samples = [[Sample(group_index=g, index=3 * g + i) for i in range(3)] for g in range(groups)]
    params = [[{"sampling_seed": 100 + 3 * g + i} for i in range(3)] for g in range(groups)]
    fn = sc.load_generate(f"{CASES}.{generate}")
    rm = None if reward is None else sc.load_reward(f"{CASES}.{reward}", group_rm)
    out = asyncio.run(sc.run_groups(args, samples, params, fn, rm, group_rm, concurrency))
    return out, args


def test_each_plugin_call_gets_the_runs_args_and_its_samples_own_sampling_params(Sample):
    """generate_and_rm_group: `generate_and_rm(args, sample, sampling_params[i], evaluation=False)` for sample i of a
    training step, the reward (one sample, or a group under --group-rm) called with the same `args`."""
    out, args = _step(Sample, "records", "reward_records", group_rm=False)
    generated = sorted(e for e in args.seen if e[0] == "generate")
    assert generated == [("generate", k, {"sampling_seed": 100 + k}, False) for k in range(6)]
    assert sorted(e[1] for e in args.seen if e[0] == "reward") == list(range(6))
    assert [s.reward for g in out for s in g] == [0.5] * 6
    out, args = _step(Sample, "records", "group_reward_records", group_rm=True)
    assert sorted(e for e in args.seen if e[0] == "group_reward") == [
        ("group_reward", [0, 1, 2]),
        ("group_reward", [3, 4, 5]),
    ]
    assert [s.reward for g in out for s in g] == [0.75] * 6


def test_at_most_the_concurrency_generate_at_a_time(Sample):
    """GenerateState's semaphore (sglang_server_concurrency x engines): held while a sample generates, so no more
    than `concurrency` of a step's samples are in flight at once; with room for all, all are."""
    for concurrency, most in ((1, 1), (2, 2), (64, 6)):
        _, args = _step(Sample, "records", None, group_rm=False, concurrency=concurrency)
        assert args.most_in_flight == most, concurrency


def test_without_group_rm_a_fan_out_is_scored_as_its_own_list(Sample):
    """Without --group-rm the step never scores a group: each generate_and_rm scores its own result, a fan-out's list
    in one batched call (the first sample of each list came back scored), with the run's `args`."""
    out, args = _step(Sample, "fan_out", "reward_records", group_rm=False, groups=1)
    assert [[s.reward for s in fan] for fan in out[0]] == [[1.0, 0.5]] * 3
    assert sorted(args.seen) == [("reward", [0]), ("reward", [1]), ("reward", [2])]  # the run's args, each list


def test_a_group_reward_that_raises_names_itself_and_the_reward_option(Sample):
    """--group-rm: what the group's reward function raises becomes the same one line as a sample's reward's."""
    with pytest.raises(BadInput) as err:
        _step(Sample, "generate", "group_reward_raises", group_rm=True)
    assert err.value.field == REWARD_OPTION and str(err.value) == (
        f"{REWARD_OPTION}: {CASES}.group_reward_raises raised ZeroDivisionError: empty label"
    )


def test_what_the_loaders_accept_is_what_slimes_own_contract_tests_accept(Sample):
    """slime's tests/plugin_contracts, run on these plugins at 624b824a (tests/slime_plugins/slime_verdicts.json,
    how in its made_by): each plugin the loaders accept passed slime's signature checks, each they refuse failed
    them (a generate function that leaves the reward to a reward function fails slime's test only for the test's
    stub arguments, which hold none)."""
    import json
    from pathlib import Path

    verdicts = json.loads((Path(cases.__file__).parent / "slime_verdicts.json").read_text())
    for name, verdict in verdicts["generate"].items():
        try:
            sc.load_generate(f"{CASES}.{name}")
            accepted = True
        except BadInput:
            accepted = False
        assert accepted == verdict["accepts"], (name, verdict["slime"])
    for verdict in verdicts["reward"]:
        try:
            sc.load_reward(f"{CASES}.{verdict['name']}", verdict["group_rm"])
            accepted = True
        except BadInput:
            accepted = False
        assert accepted == verdict["accepts"], verdict


NOT_A_SAMPLE = ", expected a Sample or a list of Samples (slime/rollout/sglang_rollout.py generate_and_rm)"


@pytest.mark.parametrize(
    "given, got",
    [
        pytest.param(None, "NoneType", id="None"),
        pytest.param({"response": "odd"}, "dict", id="a dict"),
        pytest.param([], "an empty list", id="an empty list"),
        pytest.param(lambda s: [s, None], "a list of 2 holding others", id="a list holding None"),
    ],
)
@pytest.mark.parametrize(
    "reward, group_rm",
    [pytest.param(None, False, id="no reward"), ("reward", False), pytest.param("group_reward", True, id="group_rm")],
)
def test_a_generate_function_that_returns_no_sample_is_one_line_naming_it(Sample, given, got, reward, group_rm):
    """generate_and_rm reads what came back (its status, its reward) before anything else: what is not a Sample or
    a list of Samples is refused there, naming the function, whatever scores it (issue 51: exit 3 before)."""
    with pytest.raises(BadInput) as err:
        _step(Sample, "returns_given", reward, group_rm, groups=1, given=given)
    assert str(err.value) == f"{GENERATE_OPTION}: {CASES}.returns_given returned {got}{NOT_A_SAMPLE}"


@pytest.mark.parametrize(
    "given, got",
    [
        pytest.param(0.5, "float", id="a float"),
        pytest.param(None, "NoneType", id="None"),
        pytest.param({"score": 1.0}, "dict", id="a dict"),
        pytest.param([], "a list of 0", id="an empty list"),
        pytest.param([0.5] * 4, "a list of 4", id="one too many"),
    ],
)
@pytest.mark.parametrize(
    "generate, reward, group_rm, n",
    [
        pytest.param("generate", "group_reward_given", True, 3, id="a group"),
        pytest.param("fan_out", "reward_given", False, 1, id="a fan-out's unscored"),
    ],
)
def test_a_reward_of_several_samples_is_a_list_of_one_each_else_one_line_naming_it(
    Sample, given, got, generate, reward, group_rm, n
):
    """batched_async_rm: one call for a group (--group-rm) or a fan-out's unscored samples, its values zipped onto
    them; anything but a list of one reward per sample is refused naming the reward function (issue 51: a float was
    exit 3, a short list left samples unscored)."""
    with pytest.raises(BadInput) as err:
        _step(Sample, generate, reward, group_rm, groups=1, given=given)
    assert str(err.value) == (
        f"{REWARD_OPTION}: {CASES}.{reward} returned {got}, expected a list of one reward per sample ({n}) "
        "(slime/rollout/rm_hub/__init__.py batched_async_rm)"
    )


def _trained(Sample, **changes):
    fields = dict(
        tokens=[1, 2, 3, 4, 5, 6],
        response_length=4,
        loss_mask=[1, 0, 0, 1],
        rollout_log_probs=[-0.5, 0.0, 0.0, -1.25],
        response="odd",
        status=Sample.Status.COMPLETED,
    )
    return Sample(**{**fields, **changes})


@pytest.mark.parametrize(
    "changes, line",
    [
        pytest.param(
            {"rollout_log_probs": ["-0.5", "0.0", "0.0", "-1.25"]},
            "rollout_log_probs: expected a list of numbers, got ['-0.5', '0.0', '0.0', '-1.25']",
            id="log-probs as strings",
        ),
        pytest.param(
            {"rollout_log_probs": [-0.5, None, 0.0, -1.25]},
            "rollout_log_probs: expected a list of numbers, got [-0.5, None, 0.0, -1.25]",
            id="a None log-prob",
        ),
        pytest.param(
            {"rollout_log_probs": [-0.5, True, 0.0, -1.25]},
            "rollout_log_probs: expected a list of numbers, got [-0.5, True, 0.0, -1.25]",
            id="a bool log-prob",
        ),
        pytest.param(
            {"rollout_log_probs": "abcd"},
            "rollout_log_probs: expected a list of numbers, got 'abcd'",
            id="log-probs a string",
        ),
        pytest.param({"loss_mask": 1}, "loss_mask: expected 0s and 1s in a list, got 1", id="a loss mask an int"),
        pytest.param({"response": b"odd"}, "response: expected str, got b'odd'", id="a response as bytes"),
    ],
)
def test_a_returned_sample_of_the_wrong_types_is_one_line_naming_the_field(Sample, changes, line):
    """slime's Sample: rollout_log_probs list[float], loss_mask list[int], response str (slime/utils/types.py):
    other types are refused by field before rlbench converts them (issue 51: exit 3, or strings read as numbers)."""
    with pytest.raises(BadInput) as err:
        _returned(Sample, _trained(Sample, **changes))
    assert str(err.value) == f"{GENERATE_OPTION}: my.generate: {line}"


def test_integer_log_probs_and_an_empty_response_are_what_slime_trains(Sample):
    """torch reads ints as numbers, and a response's text may be empty: neither is refused."""
    sample = _trained(Sample, rollout_log_probs=[0, -1, 0, -2], response="")
    assert _returned(Sample, sample) == [sample]
