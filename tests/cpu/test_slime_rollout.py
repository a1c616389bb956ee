"""The slime plugin runner (rlbench/slime_rollout.py) piece by piece, without a run: which functions are slime's, the
loop thread, the HTTP client's module, `args.hf_checkpoint`, the runner's set-up, a step's samples and what becomes
of them (indices, seeds, masks, rewards, status, fan-outs, aborted groups), the request log matched to turns, and
shutting down. The engine's server is a stand-in that records what it was given; the generate functions are this
module's, scripted by their prompt's metadata; the Sample is Miles' (slime's contract)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import shutil
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import RANDOM_INIT_MODEL

from rlbench import slime_rollout as sr
from rlbench.config import load_config
from rlbench.core import slime_contract as contract
from rlbench.core.types import Prompt
from rlbench.errors import BadInput

HERE = "tests.cpu.test_slime_rollout"
GENERATE_OPTION, REWARD_OPTION = contract.GENERATE_FIELD, contract.REWARD_FIELD
PROMPT_IDS = (1, 3, 4)  # 1 is the tokenizer's <|im_start|>: a special token the Sample's prompt keeps
CALLS: list = []  # (group_index, index, sampling_params) per call of `answers`, in call order
SERVER: list = [None]  # the stand-in server of the test running: `answers` logs its requests there


# ---- plugins of both shapes ------------------------------------------------------------------------------------


async def answers(args, sample, sampling_params):
    """A slime generate function: the same two response ids as the engine's request log records them (when a
    server is up), with what the prompt's metadata asks: `abort` (the sample indices in the group to abort),
    `reward` (set on the sample), `fan_out` (that many copies, `rollout_ids` set on them), `status` (a Status name),
    `remove`, `ids` (the response ids instead)."""
    script = sample.metadata
    j = sample.index % args.n_samples_per_prompt
    CALLS.append((sample.group_index, sample.index, dict(sampling_params)))
    out, logprobs = [40 + sample.index, 41], [-0.5, -0.25]
    if SERVER[0] is not None:
        SERVER[0].state.worker.request_log.append({"input_ids": [1, 2, 3], "output_ids": out, "logprobs": logprobs})
    await asyncio.sleep(0)
    sample.tokens, sample.response, sample.response_length = [1, 2, 3, *out], "ab", 2
    sample.loss_mask, sample.rollout_log_probs = [1, 1], logprobs
    status = "ABORTED" if j in script.get("abort", ()) else script.get("status", "COMPLETED")
    sample.status = type(sample).Status[status]
    sample.remove_sample = bool(script.get("remove"))
    if "reward" in script:
        sample.reward = script["reward"]
    if "ids" in script:
        sample.tokens = [1, 2, 3, *script["ids"]]
    if script.get("fan_out"):
        fan = [copy.deepcopy(sample) for _ in range(script["fan_out"])]
        for s, rollout_id in zip(fan, script.get("rollout_ids", ())):
            s.rollout_id = rollout_id  # Miles' Sample has no such field: as slime's has, set on the instance
        return fan
    return sample


def slime_sync_generate(args, sample, sampling_params):
    """slime's parameter names, not async."""


def slime_generate_evaluating(args, sample, sampling_params, evaluation=False):
    """slime's parameter names and one more after them (slime's evaluation flag), not async."""


async def async_other_names(prompt, params):
    """Async, parameters of no one's contract."""


def miles_generate(input):
    """Miles' newer shape."""


def miles_generate_evaluating(input, evaluation=False):
    """Miles' newer shape with one more parameter after `input`, not async."""


def rlbench_generate(sample, engine):
    """rlbench's own shape (core/generate.py)."""


async def slime_reward(args, sample):
    return 1.0


async def slime_group_reward(args, samples):
    return [0.25 * i for i in range(len(samples))]


def sync_args_reward(args, sample):
    """A reward with slime's first parameter, not async: slime's shape all the same (load_reward says why not)."""
    return 1.0


async def async_sample_reward(sample):
    """Async whatever its parameters: slime's (slime awaits it)."""
    return 1.0


def rlbench_reward(sample):
    """rlbench's verifier: fn(sample: RewardInput) -> float."""
    return 1.0


# ---- fixtures --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(load_config().model.tokenizer)


class FakeServer:
    """What `serve_in_thread` hands back, as far as the runner reads it; records the ServeConfig, engine and
    tokenizer it was given."""

    def __init__(self, serve=None, engine=None, tokenizer=None):
        self.serve, self.engine, self.tokenizer = serve, engine, tokenizer
        self.state = SimpleNamespace(port=4321, worker=SimpleNamespace(request_log=None), weight_version=None)
        self.closed = False

    def close(self):
        self.closed = True


def _config(generate: str = "answers", **overrides):
    return load_config(
        **{
            "rollout__custom_generate_function_path": f"{HERE}.{generate}",
            "data__prompts_per_step": 2,
            "rollout__n_samples_per_prompt": 2,
            "rollout__max_new_tokens": 2,
            "train__minibatches": 1,  # 4 samples a step: the default's 8 minibatches do not divide them
            **overrides,
        }
    )


@pytest.fixture
def started(miles, tokenizer, monkeypatch):
    """started(**overrides) -> a SlimeRollout started on the embedded engine's stand-in server (weights version 3)."""
    from rlbench.serve import server

    made = []

    def fake_serve(serve, engine, tok):
        SERVER[0] = FakeServer(serve, engine, tok)
        return SERVER[0]

    monkeypatch.setattr(server, "serve_in_thread", fake_serve)

    def make(generate: str = "answers", **overrides):
        rollout = sr.SlimeRollout(_config(generate, **overrides), tokenizer)
        rollout.start(SimpleNamespace(weight_version=3))
        made.append(rollout)
        return rollout

    CALLS.clear()
    yield make
    for rollout in made:
        rollout.close()
    SERVER[0] = None


def _prompts(*metadata: dict, first: int = 10) -> tuple[list[Prompt], dict]:
    prompts = [Prompt(first + i, ({"role": "user", "content": "q"},), f"l{i}", dict(m)) for i, m in enumerate(metadata)]
    return prompts, {p.index: PROMPT_IDS for p in prompts}


# ---- which functions are slime's -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "slime"),
    [
        ("answers", True),
        ("slime_sync_generate", True),  # slime's names: load_generate then says it must be async
        ("slime_generate_evaluating", True),  # slime's names first, whatever follows them
        ("miles_generate", True),  # Miles' shape: load_generate refuses it by name
        ("miles_generate_evaluating", True),  # Miles' first name, whatever follows it
        ("async_other_names", True),  # async: load_generate names the parameters slime expects
        ("rlbench_generate", False),
    ],
)
def test_a_generate_function_is_slimes_by_its_names_its_miles_shape_or_being_async(name, slime):
    assert sr.is_slime_generate(f"{HERE}.{name}") is slime


@pytest.mark.parametrize(
    ("name", "slime"),
    [("slime_reward", True), ("sync_args_reward", True), ("async_sample_reward", True), ("rlbench_reward", False)],
)
def test_a_reward_function_is_slimes_when_async_or_when_its_first_parameter_is_args(name, slime):
    assert sr.is_slime_reward(f"{HERE}.{name}") is slime


@pytest.mark.parametrize(
    ("check", "option"), [(sr.is_slime_generate, GENERATE_OPTION), (sr.is_slime_reward, REWARD_OPTION)]
)
def test_a_function_that_cannot_be_loaded_is_refused_naming_its_option(check, option):
    with pytest.raises(BadInput) as err:
        check(f"{HERE}.no_such_function")
    assert err.value.field == option
    assert str(err.value) == f"{option}: module '{HERE}' has no attribute 'no_such_function'"


# ---- the event loop thread -------------------------------------------------------------------------------------


def test_a_loop_thread_runs_coroutines_on_a_daemon_thread_named_for_it():
    loop = sr._LoopThread()
    try:

        async def where():
            return threading.current_thread()

        thread = asyncio.run_coroutine_threadsafe(where(), loop.loop).result(timeout=10)
        assert (
            thread.daemon is True and thread.name == "rlbench-slime-loop" and thread is not threading.current_thread()
        )
        assert loop.run(asyncio.sleep(0, result="done")) == "done"
    finally:
        loop.loop.call_soon_threadsafe(loop.loop.stop)


def test_the_process_keeps_one_loop_thread():
    loop = sr._LoopThread.get()
    assert isinstance(loop, sr._LoopThread) and sr._LoopThread.get() is loop


def test_a_coroutine_longer_than_a_waiting_slice_returns_its_result():
    async def slow():
        await asyncio.sleep(0.6)
        return "late"

    assert sr._LoopThread.get().run(slow()) == "late"


def test_a_failing_coroutine_raises_its_error_and_keeps_the_loop():
    loop = sr._LoopThread.get()

    async def fails():
        raise ValueError("the plugin failed")

    with pytest.raises(ValueError, match="the plugin failed"):
        loop.run(fails())
    assert sr._LoopThread.get() is loop
    assert loop.run(asyncio.sleep(0, result=1)) == 1


def test_ctrl_c_handed_to_the_loops_thread_stops_the_wait_and_cancels_the_coroutine():
    """SIGINT delivered to the loop's thread (the kernel hands a terminal's Ctrl-C to any thread of the process)
    while this thread waits on a coroutine of 5 s: KeyboardInterrupt here within a waiting slice, not when the
    coroutine ends, and the coroutine cancelled."""
    loop = sr._LoopThread.get()
    cancelled = threading.Event()

    async def ident():
        return threading.get_ident()

    async def long():
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    timer = threading.Timer(0.3, signal.pthread_kill, (loop.run(ident()), signal.SIGINT))
    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run(long())
    finally:
        timer.cancel()
    assert time.monotonic() - started < 4
    assert cancelled.wait(10)


def test_the_loop_counts_the_coroutines_of_run_still_on_it():
    """None on a new loop; two while one waits on the loop and another thread runs a second; one when the second
    has returned, none when both have (close reads the count: a coroutine still on the loop keeps the client)."""
    loop = sr._LoopThread()
    gate: list[asyncio.Event] = []  # what the first coroutine waits on, made on the loop
    waiting = threading.Event()

    async def held():
        gate.append(asyncio.Event())
        waiting.set()
        await gate[0].wait()
        return loop.running

    async def count():
        return loop.running

    try:
        assert loop.running == 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(loop.run, held())
            assert waiting.wait(10)
            try:
                assert loop.run(count()) == 2
            finally:
                loop.loop.call_soon_threadsafe(gate[0].set)
            assert first.result(timeout=10) == 1
        assert loop.running == 0
    finally:
        loop.loop.call_soon_threadsafe(loop.loop.stop)


# ---- the plugin side's HTTP client, args.hf_checkpoint ---------------------------------------------------------


def test_the_http_utils_are_those_beside_the_sample_class(miles):
    import miles.utils.http_utils

    assert sr._http_utils(contract.sample_class()) is miles.utils.http_utils


def test_http_utils_that_cannot_be_imported_are_one_line_saying_what_to_install():
    sample_cls = type("Sample", (), {"__module__": "nosuchpackage.utils.types"})
    with pytest.raises(BadInput) as err:
        sr._http_utils(sample_cls)
    assert err.value.field == GENERATE_OPTION and err.value.__cause__ is None and err.value.__suppress_context__
    assert str(err.value) == (
        f"{GENERATE_OPTION}: nosuchpackage.utils.http_utils cannot be imported (No module named 'nosuchpackage'): "
        "slime's plugins post through it; pip install httpx (rlbench's `slime` extra)"
    )


def _model_dirs(tmp_path: Path) -> tuple[Path, Path]:
    model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
    (tokenizer / "nested").mkdir(parents=True)
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_text("weights")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer / name).write_text(name)
    return model, tokenizer


def test_hf_checkpoint_is_the_model_directory_where_it_holds_the_tokenizer(tmp_path):
    model, _ = _model_dirs(tmp_path)
    where = tmp_path / "scratch" / "hf"
    config = SimpleNamespace(model=SimpleNamespace(path=str(model), tokenizer=str(model / ".." / "model")))
    assert sr.hf_checkpoint(config, where) == str(model.resolve())
    assert not where.exists()


def test_hf_checkpoint_elsewhere_links_the_models_config_and_the_tokenizers_files_again_and_again(tmp_path):
    """A directory two levels down, made; the model's config.json and the tokenizer's files linked (not its
    subdirectories, not the weights); a second call, into the same directory, the same."""
    model, tokenizer = _model_dirs(tmp_path)
    where = tmp_path / "scratch" / "hf"
    config = SimpleNamespace(model=SimpleNamespace(path=str(model), tokenizer=str(tokenizer)))
    for _ in range(2):
        assert sr.hf_checkpoint(config, where) == str(where)
        assert sorted(p.name for p in where.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
        assert (where / "config.json").readlink() == model / "config.json"
        assert (where / "tokenizer.json").readlink() == tokenizer / "tokenizer.json"


# ---- the runner's set-up ---------------------------------------------------------------------------------------


def test_the_runner_holds_its_plugins_and_starts_nothing(miles, tokenizer):
    config = _config(
        reward__custom_rm_path=f"{HERE}.slime_group_reward", reward__group_rm=True, rollout__sampling_seed=77
    )
    rollout = sr.SlimeRollout(config, tokenizer)
    import miles.utils.http_utils

    assert rollout.config is config and rollout.tokenizer is tokenizer and rollout.engine is None
    assert rollout.sample_cls is contract.sample_class() and rollout.source == "miles"
    assert rollout.generate_path == f"{HERE}.answers" and rollout.generate is answers
    assert rollout.reward_path == f"{HERE}.slime_group_reward" and rollout.reward is slime_group_reward
    assert rollout.http is miles.utils.http_utils and rollout.rollout_seed == 77
    assert rollout.server is None and rollout.loop is None and rollout.scratch is None and rollout.vocab == 314
    assert rollout.describe() == {
        "contract": "slime",
        "sample_class": "miles.utils.types.Sample",
        "generate": f"{HERE}.answers",
        "reward": f"{HERE}.slime_group_reward",
        "group_rm": True,
        "concurrency": 512,
    }


def test_the_rollout_seed_is_the_runs_seed_and_an_rlbench_verifier_is_not_the_plugins_reward(miles, tokenizer):
    rollout = sr.SlimeRollout(_config(seed=5, reward__custom_rm_path=f"{HERE}.rlbench_reward"), tokenizer)
    assert rollout.rollout_seed == 5 and rollout.reward_path is None and rollout.reward is None
    assert rollout.describe()["reward"] is None and rollout.describe()["group_rm"] is False


def test_a_slime_reward_of_one_sample_is_loaded_as_such(miles, tokenizer):
    rollout = sr.SlimeRollout(_config(reward__custom_rm_path=f"{HERE}.slime_reward"), tokenizer)
    assert rollout.reward is slime_reward


def test_group_rm_without_a_slime_reward_is_refused(miles, tokenizer):
    for rm in (None, f"{HERE}.rlbench_reward"):
        with pytest.raises(BadInput) as err:
            sr.SlimeRollout(_config(reward__group_rm=True, reward__custom_rm_path=rm), tokenizer)
        assert err.value.field == "reward.group_rm" and str(err.value) == (
            "reward.group_rm: --group-rm scores groups with a slime reward function (async rm(args, samples)): "
            "give one with --custom-rm-path"
        )


def test_slime_plugins_picks_the_runner_or_says_what_is_missing(miles, tokenizer):
    assert isinstance(sr.slime_plugins(_config(), tokenizer, None), sr.SlimeRollout)
    assert sr.slime_plugins(_config(), tokenizer, source="a recording") is None
    assert sr.slime_plugins(_config("rlbench_generate"), tokenizer, None) is None
    bare = load_config()
    assert sr.slime_plugins(bare, tokenizer, None) is None
    for config in (
        load_config(reward__custom_rm_path=f"{HERE}.slime_reward"),
        _config("rlbench_generate", reward__custom_rm_path=f"{HERE}.slime_reward"),
    ):
        with pytest.raises(BadInput) as err:
            sr.slime_plugins(config, tokenizer, None)
        assert err.value.field == "reward.custom_rm_path" and str(err.value) == (
            f"reward.custom_rm_path: {HERE}.slime_reward is a slime reward function (async rm(args, sample)), which "
            "slime calls from its generate_and_rm: give a slime generate function too "
            "(--custom-generate-function-path), or an rlbench verifier fn(sample: RewardInput) -> float"
        )
    assert sr.slime_plugins(load_config(reward__custom_rm_path=f"{HERE}.rlbench_reward"), tokenizer, None) is None
    with pytest.raises(BadInput) as err:
        sr.slime_plugins(load_config(reward__group_rm=True), tokenizer, None)
    assert err.value.field == "reward.group_rm"
    assert str(err.value) == "reward.group_rm: --group-rm needs a slime generate and reward function"


def test_start_serves_the_embedded_engine_and_points_args_at_it(started, tmp_path):
    """The run's model, tokenizer, device and threads (none of them the server's defaults) reach the server, which
    serves the run's own engine with the run's tokenizer; a group reward reaches the plugins' args."""
    model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
    defaults = load_config().model
    shutil.copytree(RANDOM_INIT_MODEL, model)  # started from seeded random weights: a directory without any
    shutil.copytree(defaults.tokenizer, tokenizer)
    rollout = started(
        rollout__sglang_server_concurrency=3,
        rollout__stop_token_ids=(7, 9),
        seed=11,
        model__path=str(model),
        model__tokenizer=str(tokenizer),
        model__init="random",
        device="cuda:1",
        threads=3,
        reward__custom_rm_path=f"{HERE}.slime_group_reward",
        reward__group_rm=True,
    )
    config = rollout.config
    serve = rollout.server.serve
    assert (serve.model_path, serve.tokenizer_path) == (str(model), str(tokenizer))
    assert (serve.load_format, serve.port, serve.random_seed) == ("dummy", 0, 11)
    assert (serve.device, serve.threads, serve.served_model_name) == ("cuda:1", 3, str(model))
    assert rollout.server.engine is rollout.engine and rollout.server.tokenizer is rollout.tokenizer
    assert rollout.server.state.worker.request_log == [] and rollout.engine.weight_version == 3
    args = rollout.args
    assert (args.sglang_router_ip, args.sglang_router_port, args.rollout_num_engines) == ("127.0.0.1", 4321, 1)
    assert args.rollout_seed == 11 and args.group_rm is True and args.sglang_server_concurrency == 3
    assert rollout.concurrency == 3 and rollout.loop is sr._LoopThread.get()
    assert args.hf_checkpoint == str(rollout.scratch / "hf_checkpoint") and rollout.scratch.name.startswith(
        "rlbench-slime-"
    )
    assert (rollout.scratch / "hf_checkpoint" / "config.json").is_file()
    assert rollout.http._http_client is not None
    assert rollout.base_params == contract.sampling_params(1.0, 1.0, config.rollout.top_k, 2, None, [7, 9], False)


def test_start_loads_the_checkpoint_where_the_run_starts_from_one(started):
    rollout = started(model__init="checkpoint")
    assert rollout.server.serve.load_format == "auto" and rollout.base_params["stop_token_ids"] is None


@pytest.mark.parametrize(
    ("router", "engines", "where"),
    [("http://10.1.2.3:31000", 3, ("10.1.2.3", 31000, 3)), (None, 1, ("10.9.9.9", 30001, 1))],
)
def test_start_against_sglang_points_args_at_the_router_else_the_first_server(miles, tokenizer, router, engines, where):
    config = _config(
        rollout__backend="sglang",
        rollout__sglang_router_url="http://10.1.2.3:31000",
        rollout__num_engines=engines,
        rollout__sglang_server_concurrency=4,
    )
    rollout = sr.SlimeRollout(config, tokenizer)
    fleet = SimpleNamespace(router=router, route=["http://10.9.9.9:30001", "http://10.9.9.8:30002"])
    rollout.start(SimpleNamespace(fleet=fleet, version=None))
    try:
        args = rollout.args
        assert (args.sglang_router_ip, args.sglang_router_port, args.rollout_num_engines) == where
        assert rollout.server is None and rollout.concurrency == 4 * where[2] and args.group_rm is False
    finally:
        rollout.close()


# ---- a step ----------------------------------------------------------------------------------------------------


def test_a_sample_is_handed_out_as_slimes_data_source_makes_it(miles, tokenizer):
    rollout = sr.SlimeRollout(_config(rollout__n_samples_per_prompt=4), tokenizer)
    prompt = Prompt(3, ({"role": "user", "content": "q"},), "even", {"k": [1]})
    sample = rollout._sample(5, 2, prompt, PROMPT_IDS)
    assert (sample.group_index, sample.index, sample.label, sample.metadata) == (5, 22, "even", {"k": [1]})
    assert sample.prompt == tokenizer.decode(list(PROMPT_IDS), skip_special_tokens=False)
    assert sample.prompt.startswith("<|im_start|>") and sample.metadata is not prompt.metadata


def test_a_step_numbers_groups_over_the_run_and_seeds_each_sample_by_its_place_in_the_group(started):
    rollout = started(rollout__sampling_seed=100)
    prompts, ids = _prompts({}, {})
    samples, dropped = rollout.rollout(3, prompts, ids)
    assert dropped == [] and rollout.server.state.weight_version == "3"
    assert sorted((g, i, p["sampling_seed"]) for g, i, p in CALLS) == [
        (6, 12, 100),
        (6, 13, 101),
        (7, 14, 100),
        (7, 15, 101),
    ]
    assert all({k: v for k, v in p.items() if k != "sampling_seed"} == rollout.base_params for _, _, p in CALLS)
    assert [(s.group_index, s.index, s.seed) for s in samples] == [(0, 0, 100), (0, 1, 101), (1, 2, 100), (1, 3, 101)]
    assert [(s.extra["slime_group_index"], s.extra["slime_index"], s.extra["rollout"]) for s in samples] == [
        (6, 12, 12),
        (6, 13, 13),
        (7, 14, 14),
        (7, 15, 15),
    ]
    assert [s.prompt for s in samples] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    first = samples[0]
    assert (first.prompt_ids, first.response_ids, first.rollout_log_probs) == ((1, 2, 3), (52, 41), (-0.5, -0.25))
    assert (first.engine_id, first.weight_version, first.finish_reason, first.reward) == ("serve", 3, "stop", None)
    assert first.extra["turns"] == [{"prompt_ids": [1, 2, 3], "output_ids": [52, 41]}]


def test_the_request_log_is_the_steps_own(started):
    """What an earlier step left in the server's log is cleared: a span it sampled is not this step's."""
    rollout = started()
    rollout.server.state.worker.request_log.append(
        {"input_ids": [1, 2, 3], "output_ids": [40, 41], "logprobs": [-0.5, -0.25]}
    )
    prompts, ids = _prompts({"status": "TRUNCATED"})
    rollout.rollout(0, prompts[:1], ids)
    assert [r["output_ids"][0] for r in rollout.server.state.worker.request_log] == [40, 41]


def test_a_step_at_concurrency_one_generates_one_sample_at_a_time(started):
    rollout = started(rollout__sglang_server_concurrency=1)
    active, most = [0], [0]
    original = rollout.generate

    async def counted(args, sample, params):
        active[0] += 1
        most[0] = max(most[0], active[0])
        await asyncio.sleep(0.01)
        try:
            return await original(args, sample, params)
        finally:
            active[0] -= 1

    rollout.generate = counted
    prompts, ids = _prompts({}, {})
    assert len(rollout.rollout(0, prompts, ids)[0]) == 4 and most[0] == 1
    rollout.concurrency = 4
    rollout.rollout(1, prompts, ids)
    assert most[0] == 4


def test_a_group_with_an_aborted_sample_is_dropped_and_the_rest_indexed_in_order(started):
    rollout = started()
    prompts, ids = _prompts({"abort": [1]}, {"fan_out": 2, "status": "TRUNCATED"})
    samples, dropped = rollout.rollout(0, prompts, ids)
    assert dropped == [{"group": 0, "prompt_index": 10, "aborted": [[1, 0]]}]
    assert [(s.group_index, s.index, s.extra["plugin"]["fan_out"], s.extra["rollout"]) for s in samples] == [
        (1, 0, 0, 2),
        (1, 1, 1, 2),
        (1, 2, 0, 3),
        (1, 3, 1, 3),
    ]
    assert {s.finish_reason for s in samples} == {"length"}


def test_a_step_whose_every_group_aborted_has_nothing_to_train(started):
    rollout = started()
    prompts, ids = _prompts({"abort": [0]}, {"abort": [0, 1]})
    with pytest.raises(BadInput) as err:
        rollout.rollout(4, prompts, ids)
    assert err.value.field == GENERATE_OPTION and str(err.value) == (
        f"{GENERATE_OPTION}: step 4: every group held an aborted sample (2 groups): nothing to train"
    )


@pytest.mark.parametrize("via", ["rollout", "rollout_groups"])
def test_a_reward_that_is_not_a_number_is_refused_naming_group_and_sample(started, via):
    rollout = started()
    prompts, ids = _prompts({}, {"reward": {"acc": 1.0}})
    with pytest.raises(BadInput) as err:
        if via == "rollout":
            rollout.rollout(0, prompts, ids)
        else:
            rollout.rollout_groups([(0, prompts[0], 0), (9, prompts[1], 1)], ids)
    assert err.value.field == GENERATE_OPTION and str(err.value) == (
        f"{GENERATE_OPTION}: {HERE}.answers: group 1, sample 0: reward is dict: rlbench trains a number (slime's "
        "--reward-key, which picks one out of a dict, is not modelled)"
    )


def test_groups_of_the_async_schedule_come_back_each_with_its_samples_or_what_aborted(started):
    rollout = started(rollout__sampling_seed=50)
    prompts, ids = _prompts({"fan_out": 2}, {"abort": [1]}, {})
    out = rollout.rollout_groups([(4, prompts[0], 0), (9, prompts[1], 1), (2, prompts[2], 0)], ids)
    assert [aborted for _, aborted in out] == [[], [[1, 0]], []]
    assert out[1][0] == []
    first, third = out[0][0], out[2][0]
    assert [(s.group_index, s.index, s.extra["plugin"]["fan_out"], s.extra["rollout"], s.seed) for s in first] == [
        (0, 0, 0, 8, 50),
        (0, 1, 1, 8, 50),
        (0, 2, 0, 9, 51),
        (0, 3, 1, 9, 51),
    ]
    assert [(s.group_index, s.index, s.extra["slime_group_index"]) for s in third] == [(2, 0, 2), (2, 1, 2)]
    assert all(s.prompt == prompts[2] for s in third)
    assert third[1].extra["turns"] == [{"prompt_ids": [1, 2, 3], "output_ids": [45, 41]}]


def test_a_step_scores_with_the_slime_reward_one_sample_at_a_time_or_by_group(started):
    prompts, ids = _prompts({}, {"reward": 0.5})
    samples, _ = started(reward__custom_rm_path=f"{HERE}.slime_reward").rollout(0, prompts, ids)
    assert [s.reward for s in samples] == [1.0, 1.0, 0.5, 0.5]  # a reward the plugin set is kept
    grouped = started(reward__custom_rm_path=f"{HERE}.slime_group_reward", reward__group_rm=True)
    samples, _ = grouped.rollout(0, prompts, ids)
    assert [s.reward for s in samples] == [0.0, 0.25, 0.0, 0.25]


def test_a_step_against_sglang_records_no_turns_and_the_version_pushed(miles, tokenizer):
    config = _config(rollout__backend="sglang", rollout__sglang_router_url="http://10.1.2.3:31000")
    rollout = sr.SlimeRollout(config, tokenizer)
    fleet = SimpleNamespace(router="http://10.1.2.3:31000", route=[])
    rollout.start(SimpleNamespace(fleet=fleet, version="2"))
    try:
        prompts, ids = _prompts({})
        samples, _ = rollout.rollout(0, prompts, ids)
    finally:
        rollout.close()
    assert [(s.engine_id, s.weight_version, "turns" in s.extra) for s in samples] == [("sglang", 2, False)] * 2


def test_a_returned_sample_is_held_to_slimes_rules_naming_the_plugin(started):
    prompts, ids = _prompts({"ids": [400, 41]})
    with pytest.raises(BadInput) as err:
        started().rollout(0, prompts, ids)
    assert str(err.value) == f"{GENERATE_OPTION}: {HERE}.answers: tokens: expected a list of ids in [0, 314)"


def test_a_fan_out_whose_samples_carry_a_rollout_id_trains_as_it_or_is_refused_naming_the_plugin(started):
    rollout = started()
    prompts, ids = _prompts({"fan_out": 2, "rollout_ids": [70, 70]})
    samples, _ = rollout.rollout(0, prompts, ids)
    assert [s.extra["rollout"] for s in samples] == [70] * 4
    prompts, ids = _prompts({"fan_out": 2, "rollout_ids": [70, 71]})
    with pytest.raises(BadInput) as err:
        rollout.rollout(0, prompts, ids)
    assert str(err.value).startswith(f"{GENERATE_OPTION}: {HERE}.answers: Sibling samples from one compact rollout")


# ---- one sample, converted -------------------------------------------------------------------------------------


@pytest.fixture
def convert(miles, tokenizer):
    """convert(sample, log=None, server=None, **at) -> the rlbench Sample of a slime Sample, outside a step."""
    rollout = sr.SlimeRollout(_config(), tokenizer)
    rollout.engine = SimpleNamespace(weight_version=6)
    prompt = Prompt(10, ({"role": "user", "content": "q"},), "odd", {})

    def run(sample, log=None, server=None, params=None, **at):
        rollout.server = server
        where = {"group": 1, "index": 5, "j": 1, "k": 0, "rollout_id": 8, **at}
        return rollout._convert(
            sample,
            prompt,
            where["group"],
            where["index"],
            where["j"],
            where["k"],
            where["rollout_id"],
            {"sampling_seed": 33} if params is None else params,
            log,
        )

    run.Sample = contract.sample_class()
    run.prompt = prompt
    return run


def _slime_sample(Sample, **fields):
    sample = Sample(group_index=4, index=9, tokens=[1, 2, 3, 50, 51, 52], response="xyz", response_length=3)
    sample.status = Sample.Status.COMPLETED
    sample.loss_mask, sample.rollout_log_probs = [1, 0, 1], [-1, -2.5, -3]
    for name, value in fields.items():
        setattr(sample, name, value)
    return sample


def test_a_converted_sample_keeps_the_plugins_ids_mask_log_probs_reward_and_where_it_came_from(convert):
    sample = _slime_sample(convert.Sample, reward=1, weight_versions=[2, "3"])
    out = convert(sample)
    assert (out.group_index, out.index, out.prompt) == (1, 5, convert.prompt)
    assert (out.prompt_ids, out.response_ids, out.response) == ((1, 2, 3), (50, 51, 52), "xyz")
    assert out.loss_mask == (1, 0, 1) and out.rollout_log_probs == (-1.0, -2.5, -3.0)
    assert all(type(x) is float for x in out.rollout_log_probs) and type(out.reward) is float and out.reward == 1.0
    assert (out.finish_reason, out.seed, out.engine_id, out.weight_version) == ("stop", 33, "sglang", 6)
    assert out.extra == {
        "group": 1,
        "rollout": 8,
        "slime_index": 9,
        "slime_group_index": 4,
        "status": "completed",
        "remove_sample": False,
        "has_rollout_logprobs": True,
        "weight_versions": ["2", "3"],
        "plugin": {"contract": "miles", "generate": f"{HERE}.answers", "fan_out": 0},
    }


def test_a_removed_sample_trains_nothing_and_one_without_log_probs_records_zeros(convert):
    out = convert(_slime_sample(convert.Sample, remove_sample=1, rollout_log_probs=None, loss_mask=None), k=2)
    assert out.loss_mask == (0, 0, 0) and out.rollout_log_probs == (0.0, 0.0, 0.0)
    assert out.extra["remove_sample"] is True and out.extra["has_rollout_logprobs"] is False
    assert out.extra["plugin"]["fan_out"] == 2 and out.reward is None


def test_a_sample_without_a_loss_mask_trains_every_response_token_as_one_turn(convert):
    log = [{"input_ids": [1, 2, 3], "output_ids": [50, 51, 52, 99], "logprobs": [-1, -2.5, -3, -4]}]
    out = convert(_slime_sample(convert.Sample, loss_mask=None), log=log, server=FakeServer())
    assert out.loss_mask == (1, 1, 1) and out.engine_id == "serve"
    assert out.extra["turns"] == [{"prompt_ids": [1, 2, 3], "output_ids": [50, 51, 52]}]


def test_a_sample_without_weight_versions_records_none(convert):
    """A Sample of a slime before weight_versions: nothing recorded, nothing raised."""
    sample = _slime_sample(convert.Sample)
    del sample.weight_versions
    assert convert(sample).extra["weight_versions"] == []


@pytest.mark.parametrize(
    ("status", "finish"),
    [("COMPLETED", "stop"), ("TRUNCATED", "length"), ("ABORTED", "abort"), ("FAILED", "stop"), ("PENDING", "abort")],
)
def test_a_status_becomes_its_finish_reason_and_an_unknown_one_abort(convert, status, finish):
    out = convert(_slime_sample(convert.Sample, status=convert.Sample.Status[status]))
    assert out.finish_reason == finish and out.extra["status"] == convert.Sample.Status[status].value


def test_a_sample_without_a_sampling_seed_records_seed_zero(convert):
    assert convert(_slime_sample(convert.Sample), params={}).seed == 0


@pytest.mark.parametrize(("reward", "kind"), [(True, "bool"), ("1", "str"), ({"acc": 1}, "dict")])
def test_a_reward_that_is_not_a_number_is_refused(convert, reward, kind):
    with pytest.raises(BadInput) as err:
        convert(_slime_sample(convert.Sample, reward=reward), group=2, j=3)
    assert err.value.field == GENERATE_OPTION and str(err.value) == (
        f"{GENERATE_OPTION}: {HERE}.answers: group 2, sample 3: reward is {kind}: rlbench trains a number (slime's "
        "--reward-key, which picks one out of a dict, is not modelled)"
    )


# ---- a fan-out's rollout id ------------------------------------------------------------------------------------


def _with_id(*ids):
    return [SimpleNamespace(rollout_id=i) for i in ids]


def test_a_single_sample_or_a_miles_fan_out_counts_as_the_samples_index(miles):
    assert sr._rollout_id(_with_id(None), 7, "p") == 7  # slime's default rollout_id, one sample: its index
    assert sr._rollout_id(_with_id(3), 7, "p") == 7
    Sample = contract.sample_class()
    plain, annotated = Sample(), Sample()
    annotated.rollout_id = 5  # Miles' Sample has no rollout_id: one a plugin sets on a later sibling is not read
    assert sr._rollout_id([plain, annotated], 7, "p") == 7
    assert sr._rollout_id([plain, plain, plain], 7, "p") == 7


@pytest.mark.parametrize("size", [2, 3])
def test_a_fan_out_counts_as_the_rollout_id_its_samples_share(size):
    assert sr._rollout_id(_with_id(*[4] * size), 7, "p") == 4


def test_a_fan_out_with_unset_rollout_ids_is_refused_in_slimes_words():
    """slime/observability/rollout_data_utils.py validate_rollout_id_annotated's first assertion."""
    for ids, missing in (((None, 2, None), "[0, 2]"), ((None, None), "[0, 1]")):
        with pytest.raises(BadInput) as err:
            sr._rollout_id(_with_id(*ids), 7, "pkg.gen")
        assert err.value.field == GENERATE_OPTION and str(err.value) == (
            f"{GENERATE_OPTION}: pkg.gen: Compact rollout returned {len(ids)} samples but rollout_id is unset on "
            f"positions {missing}. Set Sample.rollout_id on every sibling so the loss reducer can aggregate them as "
            "one rollout instead of N. (slime/observability/rollout_data_utils.py)"
        )


def test_a_fan_out_with_differing_rollout_ids_is_refused_in_slimes_words():
    """validate_rollout_id_annotated's second assertion."""
    with pytest.raises(BadInput) as err:
        sr._rollout_id(_with_id(3, 4), 7, "pkg.gen")
    assert err.value.field == GENERATE_OPTION and str(err.value) == (
        f"{GENERATE_OPTION}: pkg.gen: Sibling samples from one compact rollout must share rollout_id; got [3, 4]. "
        "(slime/observability/rollout_data_utils.py)"
    )


# ---- turns from the request log --------------------------------------------------------------------------------


def test_a_span_sampled_with_other_log_probs_and_one_no_request_sampled_are_turns_not_sampled():
    tokens, log = [1, 2, 10, 11, 12, 13], [{"input_ids": [1, 2], "output_ids": [10, 11], "logprobs": [-1.0, -9.0]}]
    turns = sr.match_turns(tokens, 2, [1, 1, 0, 1], [-1.0, -2.0, 0.0, -3.0], log)
    assert turns == [
        {"prompt_ids": [1, 2], "output_ids": [10, 11], "sampled": False, "why": "sampled with other log-probs"},
        {
            "prompt_ids": [1, 2, 10, 11, 12],
            "output_ids": [13],
            "sampled": False,
            "why": "no request of the step sampled these ids",
        },
    ]


def test_a_span_is_matched_to_the_request_whose_input_was_the_samples_tokens_before_it():
    log = [
        {"input_ids": [7, 7], "output_ids": [10, 11], "logprobs": [-1, -2]},
        {"input_ids": [1, 2], "output_ids": [10, 11, 12], "logprobs": [-1, -2, -3]},
        {"input_ids": [1, 3], "output_ids": [10, 11], "logprobs": [-1, -2]},
    ]
    assert sr._turn([1, 2, 10, 11], 2, 4, [-1.0, -2.0], log) == {"prompt_ids": [1, 2], "output_ids": [10, 11]}
    # none whose input was the sample's own: the first that sampled the span
    assert sr._turn([5, 10, 11], 1, 3, [-1.0, -2.0], log) == {"prompt_ids": [7, 7], "output_ids": [10, 11]}


def test_the_weight_version_is_the_embedded_engines_or_the_one_pushed_to_sglang():
    assert sr._version(SimpleNamespace(weight_version="4")) == 4
    assert sr._version(SimpleNamespace(version="7")) == 7
    assert sr._version(SimpleNamespace(version=None)) == 0


# ---- shutting down ---------------------------------------------------------------------------------------------


class FakeClient:
    closed = False

    async def aclose(self):
        self.closed = True


def test_close_closes_the_client_on_the_loop_stops_the_server_and_removes_the_scratch(started):
    rollout = started()
    scratch, server = rollout.scratch, rollout.server
    client = FakeClient()
    real, rollout.http = rollout.http, SimpleNamespace(_http_client=client)
    rollout.close()
    assert client.closed and rollout.http._http_client is None
    assert server.closed and rollout.server is None and rollout.scratch is None and not scratch.exists()
    rollout.close()  # twice: nothing left to do
    real._http_client = None


def test_close_while_a_coroutine_holds_the_loop_leaves_the_loop_and_its_client_to_it(started):
    """A step stopped by Ctrl-C whose coroutine still holds the loop (a plugin blocking it): close neither closes
    the client on the loop (it would wait on it) nor keeps it, the server and the scratch go, and the process's
    next run gets a new loop."""
    rollout = started()
    loop, server, scratch = rollout.loop, rollout.server, rollout.scratch
    client = FakeClient()
    real, rollout.http = rollout.http, SimpleNamespace(_http_client=client)
    blocking, release = threading.Event(), threading.Event()

    async def blocks():
        blocking.set()
        release.wait(10)  # synchronous: the loop runs nothing else until it returns (10 s: a broken close ends)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        step = pool.submit(loop.run, blocks())
        try:
            assert blocking.wait(10)
            rollout.close()
        finally:
            release.set()
        step.result(timeout=10)
    assert not client.closed and rollout.http._http_client is None
    assert server.closed and rollout.server is None and not scratch.exists()
    fresh = sr._LoopThread.get()
    assert isinstance(fresh, sr._LoopThread) and fresh is not loop
    loop.run(real._http_client.aclose())  # the real client, bound to the abandoned loop, closed there
    real._http_client = None
    loop.loop.call_soon_threadsafe(loop.loop.stop)


def test_close_with_http_utils_that_keep_no_client_stops_the_rest(started):
    """slime's http_utils before 2025-09 (2a3a2b67) have no `_http_client`: close stops the server and removes the
    scratch all the same."""
    rollout = started()
    server, scratch = rollout.server, rollout.scratch
    real, rollout.http = rollout.http, SimpleNamespace()
    try:
        rollout.close()
        assert server.closed and rollout.server is None and not scratch.exists()
    finally:
        rollout.http = real  # the fixture closes the real client


def test_close_of_a_runner_never_started_leaves_the_client_alone(miles, tokenizer):
    rollout = sr.SlimeRollout(_config(), tokenizer)
    client = FakeClient()
    rollout.http = SimpleNamespace(_http_client=client)
    rollout.close()
    assert not client.closed and rollout.http._http_client is client


def test_close_after_the_scratch_directory_is_gone_raises_nothing(started):
    rollout = started()
    shutil.rmtree(rollout.scratch)
    rollout.close()
    assert rollout.scratch is None
