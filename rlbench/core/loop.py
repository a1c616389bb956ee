"""The RL loop: one short function per stage, and a driver that calls them in order.

A step (slime: a rollout id) runs data -> rollout -> reward -> advantage -> logprob -> train
-> sync, then records. Each stage reads and fills one `StepState` and adds its stage's
checksum; rollout-only mode stops after `reward`. The driver holds no arithmetic.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rlbench.config import RunConfig
from rlbench.core import algo, metrics, samples
from rlbench.core.context import Context, build
from rlbench.core.reward import RewardInput, score
from rlbench.core.seeding import derive_seed
from rlbench.core.types import GenerateRequest, Prompt, Sample
from rlbench.replay import recording
from rlbench.replay.digest import tensors_digest, weights_digest


@dataclass
class StepState:
    step: int
    prompts: list[Prompt] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the recording's tensors
    batch: algo.TrainBatch | None = None
    checksums: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RunResult:
    config: RunConfig
    manifest: dict
    history: list[dict]  # each committed step's metrics, with "step"
    wall_time: float


def data(ctx: Context, state: StepState) -> None:
    state.prompts = [ctx.dataset[i] for i in ctx.cursor.indices(state.step)]
    state.checksums["data"] = tensors_digest(samples.prompt_tensors(state.prompts, ctx.prompt_ids))


def rollout(ctx: Context, state: StepState) -> None:
    cfg, n = ctx.config.rollout, ctx.config.rollout.n_samples_per_prompt
    # A sample's seed names its place (step, group, index in group), never its batch position.
    requests = [GenerateRequest(ctx.prompt_ids[p.index], derive_seed(ctx.config.seed, "sample", state.step, g, j),
                                cfg.max_new_tokens, cfg.temperature, ctx.stop_token_ids)
                for g, p in enumerate(state.prompts) for j in range(n)]
    results = ctx.engine.generate(requests)
    state.samples = [samples.to_sample(ctx.tokenizer, state.prompts[i // n], i // n, i, req, res)
                     for i, (req, res) in enumerate(zip(requests, results))]
    state.tensors = recording.flatten(state.samples)
    state.checksums["rollout_tokens"] = tensors_digest({k: state.tensors[k] for k in ("tokens", "offsets", "loss_mask")})
    state.checksums["rollout_logprobs"] = tensors_digest({"rollout_logprobs": state.tensors["rollout_logprobs"]})


def reward(ctx: Context, state: StepState) -> None:
    for s in state.samples:
        s.reward = score(ctx.reward_name, ctx.reward_fn,
                         RewardInput(s.prompt.messages, s.response, s.prompt.label, s.finish_reason, s.prompt.metadata))
    state.tensors["rewards"] = torch.tensor([s.reward for s in state.samples], dtype=torch.float32)
    state.checksums["rewards"] = tensors_digest({"rewards": state.tensors["rewards"]})
    state.metrics.update(metrics.rollout_metrics(state.samples))


def advantage(ctx: Context, state: StepState) -> None:
    state.tensors["advantages"] = algo.grpo_advantages(state.tensors["rewards"], ctx.config.rollout.n_samples_per_prompt,
                                                       ctx.config.algo.normalize_std)
    state.checksums["advantages"] = tensors_digest({"advantages": state.tensors["advantages"]})


def logprob(ctx: Context, state: StepState) -> None:
    state.batch = samples.train_batch(state.tensors)
    state.batch.old_logprobs = ctx.trainer.logprobs(state.batch.tokens) * state.batch.loss_mask
    state.tensors["old_logprobs"] = recording.unpad(state.batch.old_logprobs, state.tensors["offsets"])
    if ctx.config.algo.kl_coef > 0:
        state.batch.ref_logprobs = ctx.trainer.logprobs(state.batch.tokens, reference=True) * state.batch.loss_mask
        state.tensors["ref_logprobs"] = recording.unpad(state.batch.ref_logprobs, state.tensors["offsets"])
    state.checksums["old_logprobs"] = tensors_digest({k: state.tensors[k] for k in ("old_logprobs", "ref_logprobs")
                                                      if k in state.tensors})
    state.metrics["train/train_rollout_logprob_abs_diff"] = metrics.logprob_abs_diff(state.tensors)


def train(ctx: Context, state: StepState) -> None:
    stats = ctx.trainer.train_step(state.batch, state.step)
    state.metrics.update(stats.metrics)
    state.checksums["loss"] = tensors_digest({"losses": stats.losses})
    state.checksums["grads"] = stats.grads_digest
    state.checksums["weights"] = weights_digest(ctx.trainer.export_hf_weights())


def sync(ctx: Context, state: StepState) -> None:
    ctx.engine.update_weights(ctx.trainer.export_hf_weights(), version=state.step + 1)
    state.checksums["engine_weights"] = weights_digest(ctx.engine.export_weights())


def record(ctx: Context, state: StepState) -> None:
    if ctx.writer is None:
        return
    ctx.writer.commit_step(state.step, state.tensors, [s.metadata() for s in state.samples], state.checksums,
                           state.metrics)
    done = state.step + 1
    if ctx.trainer is not None and (done % ctx.config.checkpoint_every == 0 or done == ctx.config.steps):
        checkpoint(ctx, done)


def checkpoint(ctx: Context, steps_done: int) -> None:
    ctx.writer.write_checkpoint(steps_done, ctx.trainer.save_checkpoint(ctx.writer.root),
                                {"steps_done": steps_done, "cursor": ctx.cursor.state(steps_done),
                                 "weight_version": steps_done, "seed": ctx.config.seed})


@contextmanager
def timed(state: StepState, key: str):
    start = time.perf_counter()
    yield
    state.metrics[key] = time.perf_counter() - start


def run(config: RunConfig, on_step: Callable[[int, dict], None] | None = None) -> RunResult:
    """Run `config.steps` steps; `on_step(step, metrics)` is called as each step is handed to the
    run directory's writer. When run() returns, every step is committed to disk."""
    started = time.perf_counter()
    ctx = build(config)
    history = []
    try:
        if ctx.writer is not None and ctx.trainer is not None:
            checkpoint(ctx, 0)
        for step in range(config.steps):
            state = StepState(step)
            with timed(state, "perf/step_time"):
                with timed(state, "perf/rollout_time"):
                    data(ctx, state)
                    rollout(ctx, state)
                    reward(ctx, state)
                if ctx.trainer is not None:
                    with timed(state, "perf/train_time"):
                        advantage(ctx, state)
                        logprob(ctx, state)
                        train(ctx, state)
                        sync(ctx, state)
            record(ctx, state)
            history.append({"step": step, **state.metrics})
            if on_step is not None:
                on_step(step, state.metrics)
    finally:  # an error or Ctrl-C still lands every step already handed to the writer
        if ctx.writer is not None:
            ctx.writer.close()
        ctx.engine.close()
    return RunResult(config, ctx.manifest, history, time.perf_counter() - started)
