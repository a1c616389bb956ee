"""slime plugins under `rlbench run`: a user's custom generate function (and reward function) in slime's contract
(core/slime_contract.py), called as slime calls them, against the run's engine behind SGLang's `/generate`.

- The engine: with the embedded engine (`--rollout hf`), `rlbench serve` on a thread of this process over the
  run's own engine (so every sync reaches it), bound to a free loopback port; with `--rollout sglang`, the router
  the run already uses. `args.sglang_router_ip`/`port` point there, and the plugin side's HTTP client (slime's, or
  Miles', `utils/http_utils.init_http_client`) is initialised as slime does it.
- A step: the prompts become slime `Sample`s as slime's data source makes them (`group_index` and `index` counted
  over the whole run, the prompt as text, label and metadata), every sample generating at once under slime's
  concurrency limit on one event loop thread that lives as long as the process (slime's own `run` keeps one too,
  and the plugin side's HTTP client is bound to it). The results come back in (group, index) order, never in
  completion order, and each request's tokens are fixed by its `sampling_seed` on a batch-invariant engine: the
  step's recording is the same bits at any concurrency and whatever order the answers arrive in.
- What comes back is held to slime's rules (`slime_contract.returned`), then to the engine: the embedded engine's
  server logs every request (the ids it was given, the ids and log-probs it sampled), and each run of trainable
  tokens of a returned sample is matched to the request that sampled it. The match becomes the sample's recorded
  `turns` (the engine's own input and output ids), which `check tito` holds to the trained ids: a plugin that
  re-sends text has turns whose input is not the sample's tokens. A span no request sampled, or sampled with other
  log-probs, is recorded as such (`check tito`: mode "unsampled"). Spans of loss mask 0 (tool output) are not
  judged. Against a real SGLang fleet there is no request log: the samples are recorded without turns, and
  `check tito` judges them by evidence.
- Status: a group with an aborted sample is not trained (slime requeues aborted groups, and an aborted sample has
  no reward to normalise by); it is recorded in the step's `dropped_groups` and counted. `remove_sample` trains
  with loss mask 0, as slime's `_convert_samples_to_train_data` does. A fan-out (a list result) trains its samples
  in the step, sharing the `rollout_id` slime requires of them (recorded per sample).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import threading
from pathlib import Path
from typing import Any

from rlbench.config import RunConfig
from rlbench.core import slime_contract as contract
from rlbench.core.types import Prompt, Sample
from rlbench.core.vocab import model_vocab
from rlbench.errors import BadInput

STATUS_FINISH = {"completed": "stop", "truncated": "length", "aborted": "abort", "failed": "stop"}


def is_slime_generate(path: str) -> bool:
    """Whether the generate function at `path` has slime's shape (async, first parameters args, sample,
    sampling_params) rather than rlbench's (core/generate.py)."""
    import inspect

    from rlbench.core.plugins import load_function

    fn = load_function(path, contract.GENERATE_FIELD)
    names = list(inspect.signature(fn).parameters)
    return tuple(names[:3]) == contract.GENERATE_PARAMS or names[:1] == ["input"] or inspect.iscoroutinefunction(fn)


def is_slime_reward(path: str) -> bool:
    """Whether the reward function at `path` is slime's (async, first parameter `args`) rather than rlbench's."""
    import inspect

    from rlbench.core.plugins import load_function

    fn = load_function(path, contract.REWARD_FIELD)
    names = list(inspect.signature(fn).parameters)
    return inspect.iscoroutinefunction(fn) or names[:1] == ["args"]


class _LoopThread:
    """One asyncio event loop on a daemon thread for the process (slime's async_utils keeps one the same way):
    the plugin side's HTTP client binds to the loop it first runs on, so every run in this process uses this one."""

    _instance: _LoopThread | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.running = 0  # coroutines of run() still on the loop (counted on the loop's thread)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="rlbench-slime-loop").start()

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def run(self, coro) -> Any:
        """`coro`'s result, run on the loop; Ctrl-C while it runs cancels it (where the loop gets to the cancel)."""
        future = asyncio.run_coroutine_threadsafe(self._tracked(coro), self.loop)
        try:
            while True:  # in slices: a SIGINT the kernel hands to another thread runs its handler here, on waking
                try:
                    return future.result(timeout=0.25)
                except concurrent.futures.TimeoutError:
                    continue
        except BaseException:
            future.cancel()
            raise

    async def _tracked(self, coro) -> Any:
        self.running += 1
        try:
            return await coro
        finally:
            self.running -= 1

    def abandon(self) -> None:
        """Leave the loop to its daemon thread, held by a coroutine that did not end (a plugin that blocks it,
        calling something synchronous in a coroutine, when Ctrl-C came): nothing waits on it again, and the
        process's next run gets a new loop."""
        with _LoopThread._lock:
            if _LoopThread._instance is self:
                _LoopThread._instance = None


def _http_utils(sample_cls: type):
    """The plugin side's http_utils: slime's beside slime's Sample, Miles' beside Miles'."""
    package = sample_cls.__module__.split(".")[0]
    try:
        return importlib.import_module(f"{package}.utils.http_utils")
    except ImportError as exc:
        raise BadInput(
            f"{package}.utils.http_utils cannot be imported ({exc}): slime's plugins post through it; "
            "pip install httpx (rlbench's `slime` extra)",
            field=contract.GENERATE_FIELD,
        ) from None


def hf_checkpoint(config: RunConfig, where: Path) -> str:
    """What `args.hf_checkpoint` names: slime's plugins load the tokenizer from it. The model directory where it
    holds the run's tokenizer; else a directory under `where` linking the model's config and the tokenizer's files."""
    model, tokenizer = Path(config.model.path).resolve(), Path(config.model.tokenizer).resolve()
    if model == tokenizer:
        return str(model)
    where.mkdir(parents=True, exist_ok=True)
    for source in [model / "config.json", *sorted(tokenizer.iterdir())]:
        link = where / source.name
        if source.is_file() and not link.exists():
            link.symlink_to(source)
    return str(where)


class SlimeRollout:
    """A run's rollout through slime plugins: `rollout(step, prompts, prompt_ids)` -> the step's samples and what
    was not trained; `close()` stops the server and the plugin side's client."""

    def __init__(self, config: RunConfig, tokenizer):
        """Every input checked (the Sample class, the functions, the HTTP client's module); nothing started."""
        self.config = config
        self.tokenizer = tokenizer
        self.engine = None
        rollout, reward = config.rollout, config.reward
        self.sample_cls = contract.sample_class()
        self.source = self.sample_cls.__module__.split(".")[0]  # "slime" or "miles"
        self.generate_path = rollout.custom_generate_function_path
        self.generate = contract.load_generate(self.generate_path)
        self.reward_path = (
            reward.custom_rm_path if reward.custom_rm_path and is_slime_reward(reward.custom_rm_path) else None
        )
        self.reward = contract.load_reward(self.reward_path, reward.group_rm) if self.reward_path else None
        if reward.group_rm and self.reward is None:
            raise BadInput(
                "--group-rm scores groups with a slime reward function (async rm(args, samples)): give one with "
                "--custom-rm-path",
                field="reward.group_rm",
            )
        self.http = _http_utils(self.sample_cls)
        self.rollout_seed = config.seed if rollout.sampling_seed is None else rollout.sampling_seed
        self.server = None
        self.loop = None
        self.scratch: Path | None = None
        self.vocab = model_vocab(config.model.path)  # core/vocab.py: the ids the engine samples

    def describe(self) -> dict:
        """The manifest's record of the plugins and the contract they were called with."""
        return {
            "contract": "slime",
            "sample_class": f"{self.sample_cls.__module__}.{self.sample_cls.__qualname__}",
            "generate": self.generate_path,
            "reward": self.reward_path,
            "group_rm": self.config.reward.group_rm,
            "concurrency": self.config.rollout.sglang_server_concurrency,
        }

    def start(self, engine) -> None:
        """The engine behind /generate (the embedded one served on a thread), `args` pointed at it, the plugin
        side's HTTP client initialised."""
        config, rollout, reward = self.config, self.config.rollout, self.config.reward
        self.engine = engine
        if rollout.backend == "hf":
            from rlbench.serve.server import ServeConfig, serve_in_thread

            serve = ServeConfig(
                model_path=config.model.path,
                tokenizer_path=config.model.tokenizer,
                load_format="auto" if config.model.init == "checkpoint" else "dummy",
                port=0,
                random_seed=config.seed,
                device=config.device,
                threads=config.threads,
                served_model_name=config.model.path,
            )
            self.server = serve_in_thread(serve, engine, self.tokenizer)
            self.server.state.worker.request_log = []
            host, port, engines = "127.0.0.1", self.server.state.port, 1
        else:
            from urllib.parse import urlsplit

            # the router the run uses (without one, use_router = false, the first server: slime posts to one URL)
            url = urlsplit(engine.fleet.router or engine.fleet.route[0])
            host, port, engines = url.hostname, url.port, max(1, rollout.num_engines)
        self.args = contract.plugin_args(config, host, port, engines, self.rollout_seed, reward.group_rm)
        import tempfile

        self.scratch = Path(tempfile.mkdtemp(prefix="rlbench-slime-"))
        self.args.hf_checkpoint = hf_checkpoint(config, self.scratch / "hf_checkpoint")
        self.args.sglang_server_concurrency = rollout.sglang_server_concurrency
        self.concurrency = rollout.sglang_server_concurrency * engines
        self.loop = _LoopThread.get()
        self.http.init_http_client(self.args)
        self.base_params = contract.sampling_params(
            rollout.temperature,
            rollout.top_p,
            rollout.top_k,
            rollout.max_new_tokens,
            None,
            list(rollout.stop_token_ids) or None,
            False,
        )

    # ---- a step -----------------------------------------------------------------------------------------------

    def _sample(self, gid: int, j: int, prompt: Prompt, ids: tuple[int, ...]):
        """A slime Sample as slime's data source hands it out: group `gid` and sample indices counted over the run,
        the prompt as its text, with its label and metadata."""
        n = self.config.rollout.n_samples_per_prompt
        return self.sample_cls(
            group_index=gid,
            index=gid * n + j,
            prompt=self.tokenizer.decode(list(ids), skip_special_tokens=False),
            label=prompt.label,
            metadata=dict(prompt.metadata),
        )

    def _run_groups(self, groups: list[tuple[int, Prompt]], prompt_ids: dict[int, tuple[int, ...]]):
        """Run the plugins over groups (run-wide number, prompt): for each group what came back, (j, fan-out k,
        rollout id, the Sample, its sampling params) each; and the served engine's request log."""
        n = self.config.rollout.n_samples_per_prompt
        made_groups = [[self._sample(gid, j, p, prompt_ids[p.index]) for j in range(n)] for gid, p in groups]
        params = [contract.group_params(self.base_params, n, self.rollout_seed, True) for _ in made_groups]
        if self.server is not None:
            self.server.state.worker.request_log.clear()
            self.server.state.weight_version = str(_version(self.engine))
        results = self.loop.run(
            contract.run_groups(
                self.args,
                made_groups,
                params,
                self.generate,
                self.reward,
                self.config.reward.group_rm,
                self.concurrency,
            )
        )
        log = list(self.server.state.worker.request_log) if self.server is not None else None
        out = []
        for g, group in enumerate(results):
            made = []
            for j, result in enumerate(group):
                returned = contract.returned(result, self.sample_cls, self.generate_path, self.vocab)
                rollout_id = _rollout_id(returned, made_groups[g][j].index, self.generate_path)
                for k, s in enumerate(returned):
                    made.append((j, k, rollout_id, s, params[g][j]))
            out.append(made)
        return out, log

    def _aborted(self, made: list) -> list[list[int]]:
        return [[j, k] for j, k, _, s, _ in made if s.status == self.sample_cls.Status.ABORTED]

    def rollout(self, step: int, prompts: list[Prompt], prompt_ids: dict[int, tuple[int, ...]]):
        """The step's samples in (group, index) order (a fan-out's in its list's order), and the groups not trained."""
        per_step = self.config.data.prompts_per_step
        results, log = self._run_groups([(step * per_step + g, p) for g, p in enumerate(prompts)], prompt_ids)
        out: list[Sample] = []
        dropped: list[dict] = []
        for g, (prompt, made) in enumerate(zip(prompts, results)):
            aborted = self._aborted(made)
            if aborted:
                dropped.append({"group": g, "prompt_index": prompt.index, "aborted": aborted})
                continue
            for j, k, rollout_id, s, p in made:
                out.append(self._convert(s, prompt, g, len(out), j, k, rollout_id, p, log))
        if not out:
            raise BadInput(
                f"step {step}: every group held an aborted sample ({len(dropped)} groups): nothing to train",
                field=contract.GENERATE_FIELD,
            )
        return out, dropped

    def rollout_groups(self, groups: list[tuple[int, Prompt, int]], prompt_ids: dict[int, tuple[int, ...]]):
        """For the async schedule (core/pipeline.py): groups (run-wide number, prompt, attempt) run as slime's
        worker runs them; for each, its samples (group and index its place in the call: the step re-indexes them)
        and which aborted. An attempt draws slime's seeds again (rollout_seed + index in group), as slime's
        requeued groups do."""
        results, log = self._run_groups([(gid, p) for gid, p, _ in groups], prompt_ids)
        out = []
        for g, ((_, prompt, _), made) in enumerate(zip(groups, results)):
            aborted = self._aborted(made)
            samples = []
            for i, (j, k, rollout_id, sample, params) in enumerate([] if aborted else made):
                samples.append(self._convert(sample, prompt, g, i, j, k, rollout_id, params, log))
            out.append((samples, aborted))
        return out

    def _convert(self, s, prompt: Prompt, group: int, index: int, j: int, k: int, rollout_id, params, log) -> Sample:
        length = s.response_length
        tokens = list(s.tokens)
        prompt_len = len(tokens) - length
        mask = [0] * length if s.remove_sample else list(s.loss_mask if s.loss_mask is not None else [1] * length)
        has_logprobs = s.rollout_log_probs is not None
        logprobs = [float(x) for x in s.rollout_log_probs] if has_logprobs else [0.0] * length
        reward = s.reward
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise BadInput(
                f"{self.generate_path}: group {group}, sample {j}: reward is {type(reward).__name__}: rlbench trains a "
                "number (slime's --reward-key, which picks one out of a dict, is not modelled)",
                field=contract.GENERATE_FIELD,
            )
        status = s.status.value
        extra = {
            "group": group,
            "rollout": rollout_id,  # the rollout it trains as: slime's Sample.rollout_id, else its index
            "slime_index": s.index,
            "slime_group_index": s.group_index,
            "status": status,
            "remove_sample": bool(s.remove_sample),
            "has_rollout_logprobs": has_logprobs,
            "weight_versions": [str(v) for v in getattr(s, "weight_versions", [])],
            "plugin": {"contract": self.source, "generate": self.generate_path, "fan_out": k},
        }
        if log is not None:
            extra["turns"] = match_turns(tokens, prompt_len, list(s.loss_mask or [1] * length), logprobs, log)
        return Sample(
            group_index=group,
            index=index,
            prompt=prompt,
            prompt_ids=tuple(tokens[:prompt_len]),
            response_ids=tuple(tokens[prompt_len:]),
            response=s.response,
            rollout_log_probs=tuple(logprobs),
            loss_mask=tuple(mask),
            finish_reason=STATUS_FINISH.get(status, "abort"),
            seed=params.get("sampling_seed", 0),
            engine_id="serve" if self.server is not None else "sglang",
            weight_version=_version(self.engine),
            reward=None if reward is None else float(reward),
            extra=extra,
        )

    def close(self) -> None:
        client = getattr(self.http, "_http_client", None)
        if client is not None and self.loop is not None:  # bound to this run's server: a next run makes its own
            if self.loop.running:  # a step stopped by Ctrl-C left a coroutine on the loop: the client goes with it
                self.loop.abandon()
            else:
                self.loop.run(client.aclose())
            self.http._http_client = None
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.scratch is not None:
            import shutil

            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def _version(engine) -> int:
    """The weight version the engine holds: the embedded engine's, or the one the run pushed to SGLang's."""
    if hasattr(engine, "weight_version"):
        return int(engine.weight_version)
    return int(engine.version) if engine.version is not None else 0


def _rollout_id(returned: list, index: int, path: str) -> int:
    """The rollout a returned sample trains as: its sample's index (slime's default), or the `rollout_id` every
    sample of a fan-out shares, which slime requires of them (rollout_data_utils.validate_rollout_id_annotated;
    Miles' Sample has no such field: its fan-outs count as the sample's index)."""
    if len(returned) < 2 or not hasattr(returned[0], "rollout_id"):
        return index
    ids = [s.rollout_id for s in returned]
    missing = [i for i, rid in enumerate(ids) if rid is None]
    if missing:
        raise BadInput(
            f"{path}: Compact rollout returned {len(returned)} samples but rollout_id is unset on positions "
            f"{missing}. Set Sample.rollout_id on every sibling so the loss reducer can aggregate them as one "
            "rollout instead of N. (slime/observability/rollout_data_utils.py)",
            field=contract.GENERATE_FIELD,
        )
    if len(set(ids)) != 1:
        raise BadInput(
            f"{path}: Sibling samples from one compact rollout must share rollout_id; got {ids}. "
            "(slime/observability/rollout_data_utils.py)",
            field=contract.GENERATE_FIELD,
        )
    return ids[0]


def match_turns(tokens: list[int], prompt_len: int, mask: list[int], logprobs: list[float], log: list[dict]):
    """Each run of trainable tokens of a sample, matched to the request of the step that sampled it: the request
    whose output starts with the run's ids and log-probs, preferring one whose input was the sample's tokens
    before the run (a sampled turn of this trajectory). Its input and output ids are the turn; a run no request
    sampled so is a turn marked `"sampled": false` (its own ids, the position it starts at)."""
    turns, start = [], None
    for p in range(prompt_len, len(tokens) + 1):
        inside = p < len(tokens) and mask[p - prompt_len] == 1
        if inside and start is None:
            start = p
        elif not inside and start is not None:
            turns.append(_turn(tokens, start, p, logprobs[start - prompt_len : p - prompt_len], log))
            start = None
    return turns


def _turn(tokens: list[int], start: int, end: int, logprobs: list[float], log: list[dict]) -> dict:
    span, before = tokens[start:end], tokens[:start]
    found = [
        r
        for r in log
        if r["output_ids"][: len(span)] == span and [float(x) for x in r["logprobs"][: len(span)]] == logprobs
    ]
    if not found:
        same_ids = any(r["output_ids"][: len(span)] == span for r in log)
        return {
            "prompt_ids": before,
            "output_ids": span,
            "sampled": False,
            "why": "sampled with other log-probs" if same_ids else "no request of the step sampled these ids",
        }
    best = next((r for r in found if r["input_ids"] == before), found[0])
    return {"prompt_ids": list(best["input_ids"]), "output_ids": span}


def slime_plugins(config: RunConfig, tokenizer, source) -> SlimeRollout | None:
    """The run's slime plugins (rlbench/slime_rollout.py), where it generates with a generate function of slime's
    shape; None for rlbench's own contract (core/generate.py) and for runs without one. A reward function of
    slime's shape needs one: it scores inside slime's generate_and_rm."""
    if source is not None:
        return None
    path, rm = config.rollout.custom_generate_function_path, config.reward.custom_rm_path
    if path and is_slime_generate(path):
        return SlimeRollout(config, tokenizer)
    if rm and is_slime_reward(rm):
        raise BadInput(
            f"{rm} is a slime reward function (async rm(args, sample)), which slime calls from its generate_and_rm: "
            "give a slime generate function too (--custom-generate-function-path), or an rlbench verifier "
            "fn(sample: RewardInput) -> float",
            field="reward.custom_rm_path",
        )
    if config.reward.group_rm:
        raise BadInput("--group-rm needs a slime generate and reward function", field="reward.group_rm")
    return None
