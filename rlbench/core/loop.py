"""The RL loop: one short function per stage, and a driver that calls them in order.

A step (slime: a rollout id) runs data -> rollout -> reward -> advantage -> logprob -> train
-> sync, then records. Each stage reads and fills one `StepState` and adds its stage's
checksum. Modes cut the line: rollout-only stops after `reward`; train-only (and replay) takes
data..reward from a recording (`recorded`) and has no engine, so no `sync`. With `expect`, each
step's checksums are compared with known ones as soon as it is computed, and the first stage
that differs raises `Diverged`. The driver holds no arithmetic.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlbench.core import algo, critic_stages, metrics, samples, weight_check
from rlbench.core.context import Context
from rlbench.core.plugins import call_plugin
from rlbench.core.reward import RewardInput, score
from rlbench.core.seeding import derive_seed
from rlbench.core.types import GenerateRequest, Prompt, Sample
from rlbench.errors import BadInput, Divergence, NonFinite
from rlbench.rundir import recording
from rlbench.rundir.directory import CHECKSUM_KEYS
from rlbench.rundir.digest import tensors_digest, weights_digests


class Diverged(Divergence):
    """A step's checksum differs from the expected one: the first (step, stage) where runs part."""

    def __init__(self, step: int, stage: str, expected: str, got: str):
        self.step, self.stage, self.expected, self.got = step, stage, expected, got
        super().__init__(f"step {step}, stage {stage}: expected {expected[:12]}, got {got[:12]}")


@dataclass
class StepState:
    step: int
    prompts: list[Prompt] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    sample_meta: list[dict] = field(default_factory=list)  # the recording's JSON half
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the recording's tensors
    batch: algo.TrainBatch | None = None
    checksums: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # per-parameter digests, kept in the recording's JSON


def data(ctx: Context, state: StepState) -> None:
    state.prompts = [ctx.dataset[i] for i in ctx.cursor.indices(state.step)]
    state.checksums["data"] = tensors_digest(samples.prompt_tensors(state.prompts, ctx.prompt_ids))


def step_requests(ctx: Context, state: StepState) -> list[GenerateRequest]:
    """The step's engine requests, group after group; a sample's seed names its place (step,
    group, index in group), never its batch position."""
    n = ctx.config.rollout.n_samples_per_prompt
    return [
        group_request(ctx, ctx.prompt_ids[p.index], state.step, g, j)
        for g, p in enumerate(state.prompts)
        for j in range(n)
    ]


def group_request(ctx: Context, prompt_ids: tuple[int, ...], step: int, group: int, j: int) -> GenerateRequest:
    """Sample `j` of the `group`-th prompt drawn for `step`: its seed named by that place, with the run's sampling
    settings."""
    cfg = ctx.config.rollout
    seed = ctx.config.seed if cfg.sampling_seed is None else cfg.sampling_seed
    return GenerateRequest(
        prompt_ids,
        derive_seed(seed, "sample", step, group, j),
        cfg.max_new_tokens,
        cfg.temperature,
        ctx.stop_token_ids,
        cfg.top_k,
        cfg.top_p,
    )


def generate(ctx: Context, requests: list[GenerateRequest], prompts: list[Prompt]) -> list[Sample]:
    """The requests' samples, `prompts` the prompt of each, `n_samples_per_prompt` to a group: the run's engine, or
    its custom generate function called once a sample."""
    n = ctx.config.rollout.n_samples_per_prompt
    if ctx.generate_fn is not None:
        return [
            samples.from_trajectory(
                call_plugin(
                    ctx.generate_fn,
                    "generate function",
                    ctx.generate_name,
                    ctx.generate_env,
                    prompt,
                    req.prompt_ids,
                    req.seed,
                ),
                ctx.generate_name,
                prompt,
                i // n,
                i,
                req,
            )
            for i, (req, prompt) in enumerate(zip(requests, prompts))
        ]
    results = ctx.engine.generate(requests)
    return [
        samples.to_sample(ctx.tokenizer, prompt, i // n, i, req, res)
        for i, (req, res, prompt) in enumerate(zip(requests, results, prompts))
    ]


def rollout(ctx: Context, state: StepState) -> None:
    n = ctx.config.rollout.n_samples_per_prompt
    if ctx.plugin_rollout is not None:  # slime plugins: the samples as they return them, the data as trained
        state.samples, dropped = ctx.plugin_rollout.rollout(state.step, state.prompts, ctx.prompt_ids)
        if dropped:
            state.extra["dropped_groups"] = dropped
        state.tensors = samples.flatten(state.samples)
        state.checksums["data"] = tensors_digest(samples.recorded_prompt_tensors(state.tensors))
        _finite(state, "rollout", "rollout_logprobs", state.tensors["rollout_logprobs"], "the plugin's log-probs")
        _checksum_rollout(state)
        return
    requests = step_requests(ctx, state)
    state.samples = generate(ctx, requests, [state.prompts[i // n] for i in range(len(requests))])
    state.tensors = samples.flatten(state.samples)
    if ctx.generate_fn is not None:  # its trajectories' own prompt ids (a chat with tools) are what is recorded
        state.checksums["data"] = tensors_digest(samples.recorded_prompt_tensors(state.tensors))
    _finite(state, "rollout", "rollout_logprobs", state.tensors["rollout_logprobs"], "the engine's log-probs")
    _checksum_rollout(state)


def rollout_async(ctx: Context, state: StepState, pipe) -> None:
    """An async step's rollout (core/pipeline.py): the groups the schedule gives the step, generated ahead or now;
    the weights version each step trains from, its engine's, and each requeued or dropped group recorded."""
    groups, log = pipe.take(state.step)
    state.prompts = [g.prompt for g in groups]
    state.samples = pipe.samples(groups, state.step)
    state.extra["async"] = {
        "mode": pipe.mode,
        "trained_version": state.step,  # the weights the step trains from: steps trained before it
        "engine_version": pipe.engine_version(state.step),
        "requeued": log,
    }
    state.tensors = samples.flatten(state.samples)
    if ctx.plugin_rollout is not None or ctx.generate_fn is not None:  # the samples' own prompt ids, as recorded
        state.checksums["data"] = tensors_digest(samples.recorded_prompt_tensors(state.tensors))
    else:
        state.checksums["data"] = tensors_digest(samples.prompt_tensors(state.prompts, ctx.prompt_ids))
    _finite(state, "rollout", "rollout_logprobs", state.tensors["rollout_logprobs"], "the engine's log-probs")
    _checksum_rollout(state)


def reward(ctx: Context, state: StepState) -> None:
    for s in state.samples:
        if s.reward is not None:  # set by a slime plugin (its generate or reward function): kept, and said so
            s.extra.setdefault("reward_from", "plugin")
            continue
        if ctx.reward_fn is None:
            raise BadInput(
                f"step {state.step}: sample {s.index} has no reward, and {ctx.reward_name} scores in the rollout",
                field="reward.custom_rm_path",
            )
        s.reward = score(
            ctx.reward_name,
            ctx.reward_fn,
            RewardInput(s.prompt.messages, s.response, s.prompt.label, s.finish_reason, s.prompt.metadata),
        )
    state.tensors["rewards"] = torch.tensor([s.reward for s in state.samples], dtype=torch.float32)
    _finite(state, "reward", "rewards", state.tensors["rewards"], ctx.reward_name)
    state.sample_meta = [s.metadata() for s in state.samples]
    _checksum_rewards(state)


def recorded(ctx: Context, state: StepState) -> None:
    """Train-only and replay: data, rollout and reward come from the recording, verified on read."""
    tensors, meta = recording.read_step(Path(ctx.config.rollouts), state.step)
    state.tensors = {k: tensors[k] for k in recording.REQUIRED}  # inputs only: later stages recompute the rest
    state.sample_meta = meta["samples"]
    source = f"the recording {Path(ctx.config.rollouts) / 'rollouts' / (f'{state.step:06d}.safetensors')}"
    _finite(state, "recorded", "rewards", state.tensors["rewards"], source)
    _finite(state, "recorded", "rollout_logprobs", state.tensors["rollout_logprobs"], source)
    checksum_inputs(state)


def _finite(state: StepState, stage: str, name: str, values: torch.Tensor, source: str = "") -> None:
    """Stop before the step commits when a value is NaN or infinite, naming the stage, the place and
    the value: training on it would only spread it, and committed steps must stay resumable."""
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    first = int(bad.reshape(-1).nonzero()[0])
    if name.endswith("logprobs") or name in ("values", "token_advantages"):  # token-aligned
        offsets = state.tensors["offsets"]
        sample = int(torch.searchsorted(offsets, torch.tensor(first), right=True)) - 1
        place = f"sample {sample}, token {first - int(offsets[sample])}"
    else:
        mean = "the mean over minibatches"
        place = {
            "losses": f"minibatch {first}",
            "critic_losses": f"minibatch {first}",
            "train/grad_norm": mean,
            "train/critic-grad_norm": mean,
        }.get(name, f"sample {first}")
    raise NonFinite(
        f"step {state.step}, stage {stage}: {name} is {values.reshape(-1)[first].item()} at {place}"
        f"{f' ({source})' if source else ''}; the step was not committed, the committed steps are kept"
    )


# Which recorded tensors each checksum covers, in order: one definition for the loop, replay and diff.
RECORDED_DIGESTS = {
    "rollout_tokens": ("tokens", "offsets", "loss_mask"),
    "rollout_logprobs": ("rollout_logprobs",),
    "rewards": ("rewards",),
    "values": ("values",),
    "advantages": ("advantages", "token_advantages", "returns"),
    "critic_loss": ("critic_losses",),
    "old_logprobs": ("old_logprobs", "ref_logprobs"),
    "loss": ("losses",),
}


def _digest(tensors: dict[str, torch.Tensor], key: str) -> str:
    return tensors_digest({name: tensors[name] for name in RECORDED_DIGESTS[key] if name in tensors})


def recorded_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The checksums a step's recorded tensors determine (data..rewards always; advantages,
    old_logprobs and loss where the recording holds them): what a reader verifies a recording by."""
    out = {"data": tensors_digest(samples.recorded_prompt_tensors(tensors))}
    out.update(
        {key: _digest(tensors, key) for key, names in RECORDED_DIGESTS.items() if any(n in tensors for n in names)}
    )
    return out


def checksum_inputs(state: StepState) -> None:
    """data, rollout and reward checksums (and rollout metrics) of a recording's input tensors."""
    state.checksums["data"] = tensors_digest(samples.recorded_prompt_tensors(state.tensors))
    _checksum_rollout(state)
    _checksum_rewards(state)


def _checksum_rollout(state: StepState) -> None:
    state.checksums["rollout_tokens"] = _digest(state.tensors, "rollout_tokens")
    state.checksums["rollout_logprobs"] = _digest(state.tensors, "rollout_logprobs")


def _checksum_rewards(state: StepState) -> None:
    state.checksums["rewards"] = _digest(state.tensors, "rewards")
    state.metrics.update(metrics.rollout_metrics(state.tensors, [m["finish_reason"] for m in state.sample_meta]))


def train_stages(ctx: Context, state: StepState) -> None:
    """advantage, logprob, train; with PPO's critic (core/critic_stages.py) its values before the advantage and its
    step after it, and no logprob or train on the critic-only steps (slime's order)."""
    if ctx.critic is not None:
        values(ctx, state)
    advantage(ctx, state)
    if ctx.critic is not None:
        critic_train(ctx, state)
    if critic_stages.actor_trains(ctx, state.step):
        logprob(ctx, state)
        train(ctx, state)
        if ctx.critic is not None:
            state.metrics.update(critic_stages.rollout_metrics(state))


def values(ctx: Context, state: StepState) -> None:
    """PPO: the critic's values before its update (core/critic_stages.py)."""
    critic_stages.values(ctx, state, _finite)


def advantage(ctx: Context, state: StepState) -> None:
    if ctx.critic is not None:  # GAE's per-token advantages and returns from the critic's values
        critic_stages.advantage(ctx, state, _finite)
    else:
        state.tensors["advantages"] = algo.advantages(
            state.tensors["rewards"], groups(ctx, state), samples.token_counts(state.tensors), ctx.config.algo
        )
        _finite(state, "advantage", "advantages", state.tensors["advantages"])
    state.checksums["advantages"] = _digest(state.tensors, "advantages")


def critic_train(ctx: Context, state: StepState) -> None:
    """PPO: the critic's step, before the actor's (core/critic_stages.py)."""
    critic_stages.critic_train(ctx, state, _finite)


def groups(ctx: Context, state: StepState) -> int | torch.Tensor:
    """The step's groups: each sample's "group" from its recorded metadata where every sample has one
    (a slime import, slime's group_index: groups of any size), else consecutive groups of
    n_samples_per_prompt (a live run's, and a recording without them)."""
    given = ["group" in m for m in state.sample_meta]
    source = f"the recording of step {state.step}"
    if any(given):
        ids = [m.get("group") for m in state.sample_meta]
        if not all(given) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in ids):
            first = next(i for i, g in enumerate(ids) if not isinstance(g, int) or isinstance(g, bool) or g < 0)
            raise BadInput(
                f"{source}: sample {first}'s group is {ids[first]!r}; expected an integer >= 0 on every "
                "sample (or on none)",
                field="samples.group",
            )
        return torch.tensor(ids, dtype=torch.long)
    n = len(state.tensors["rewards"])
    if n % ctx.group_size:
        raise BadInput(
            f"{source}: {n} samples do not make groups of n_samples_per_prompt = {ctx.group_size}, and "
            "its samples name no group",
            field="samples.group",
        )
    return ctx.group_size


def logprob(ctx: Context, state: StepState) -> None:
    state.batch = samples.train_batch(state.tensors)
    state.batch.rollouts = samples.rollouts(state.sample_meta)
    per_sample = ctx.config.rollout.true_on_policy
    state.batch.old_logprobs = (
        ctx.trainer.logprobs(state.batch.tokens, lengths=state.batch.lengths, per_sample=per_sample)
        * state.batch.loss_mask
    )
    state.tensors["old_logprobs"] = recording.unpad(state.batch.old_logprobs, state.tensors["offsets"])
    _finite(state, "logprob", "old_logprobs", state.tensors["old_logprobs"], "the trainer's forward")
    if ctx.config.algo.kl_coef > 0:
        state.batch.ref_logprobs = ctx.trainer.logprobs(state.batch.tokens, reference=True) * state.batch.loss_mask
        state.tensors["ref_logprobs"] = recording.unpad(state.batch.ref_logprobs, state.tensors["offsets"])
    known = torch.tensor([m.get("has_rollout_logprobs", True) is not False for m in state.sample_meta])
    if ctx.config.algo.use_tis:
        if not bool(known.all()):
            raise BadInput(
                f"step {state.step}: sample {int((~known).nonzero()[0])} has no rollout log-probs, which TIS weighs by",
                field="algo.use_tis",
            )
        state.batch.rollout_logprobs = samples.padded_rollout_logprobs(state.tensors) * state.batch.loss_mask
    state.checksums["old_logprobs"] = _digest(state.tensors, "old_logprobs")
    if bool(known.any()):  # none: the metrics are left out (as slime, without rollout log-probs), never 0
        per_token = ctx.config.algo.per_token_loss
        state.metrics["train/train_rollout_logprob_abs_diff"] = metrics.logprob_abs_diff(
            state.tensors, per_token, known
        )
        state.metrics["train/rollout_logprob_abs_diff_token_mean"] = metrics.logprob_abs_diff_token_mean(
            state.tensors, known
        )


def train(ctx: Context, state: StepState) -> None:
    stats = ctx.trainer.train_step(state.batch, state.step)
    _finite(state, "train", "losses", stats.losses)
    _finite(state, "train", "train/grad_norm", torch.tensor([stats.metrics["train/grad_norm"]]))
    weights = ctx.trainer.export_hf_weights()
    state.metrics.update(stats.metrics)
    state.tensors["losses"] = stats.losses
    state.checksums["loss"] = _digest(state.tensors, "loss")
    state.checksums["grads"] = stats.grads_digest
    state.checksums["weights"], per_tensor = weights_digests(weights)
    state.extra["param_digests"] = {"grads": stats.param_grads, "weights": per_tensor}


def sync(ctx: Context, state: StepState) -> None:
    interval = ctx.config.rollout.update_weights_interval
    if (state.step + 1) % interval:  # slime's --update-weights-interval: the engine keeps the weights it holds
        state.checksums["engine_weights"] = weight_check.check_unchanged(
            ctx.engine, ctx.synced, f"step {state.step}, no sync (every {interval} steps)"
        )
        return
    weights = ctx.trainer.export_hf_weights()
    ctx.engine.update_weights(weights, version=state.step + 1)
    if getattr(ctx.engine, "wire_bytes", None) is not None:  # the SGLang engine's: what the sync wrote (slime's name)
        state.metrics["perf/update_weights_wire_bytes"] = ctx.engine.wire_bytes
    # The train stage checksummed this same export (nothing trains between): the engine is held to those checksums,
    # or to what it holds of them where it casts or quantizes them (rollout.dtype, rollout.quantization).
    held = weight_check.held_by(ctx.engine, weights)
    per_tensor = state.extra.get("param_digests", {}).get("weights")
    if held is weights and per_tensor is not None:
        ctx.synced = (state.checksums["weights"], per_tensor)
    else:
        ctx.synced = weights_digests(held)
    state.checksums["engine_weights"] = weight_check.check_engine(
        ctx.engine, held, f"step {state.step}, sync", ctx.synced
    )


def first_sync(ctx: Context, start: int) -> None:
    """Before the first step the engine takes the trainer's weights (on resume the trainer holds a
    checkpoint the engine has not seen). At step 0 the weights the model was built with are the
    reference the trainer's export must equal (weight_check.py)."""
    weights = ctx.trainer.export_hf_weights()
    if ctx.model_weights is not None:
        weight_check.check(ctx.model_weights, weights, "before step 0, first sync", labels=("model", "trainer"))
        ctx.model_weights = None
    ctx.engine.update_weights(weights, version=start)
    held = weight_check.held_by(ctx.engine, weights)
    ctx.synced = weights_digests(held)
    weight_check.check_engine(ctx.engine, held, f"before step {start}, first sync", ctx.synced)


def verify(expected: dict[str, str], state: StepState) -> None:
    """Raise `Diverged` at the first stage, in loop order, whose checksum differs from `expected`."""
    for stage in CHECKSUM_KEYS:
        if stage in expected and stage in state.checksums and expected[stage] != state.checksums[stage]:
            raise Diverged(state.step, stage, expected[stage], state.checksums[stage])


def record(ctx: Context, state: StepState, commit: bool = True) -> None:
    """Commit the step (unless it is a recomputed, already committed one) and write a due checkpoint
    (a recomputed step writes one only if a crash kept it from being written the first time)."""
    if ctx.writer is None:
        return
    if commit:
        ctx.writer.commit_step(
            state.step, state.tensors, state.sample_meta, state.checksums, state.metrics, state.extra
        )
    done = state.step + 1
    if ctx.trainer is not None and (done % ctx.config.checkpoint_every == 0 or done == ctx.config.steps):
        if commit or not ctx.writer.has_checkpoint(done):
            checkpoint(ctx, done)


def checkpoint(ctx: Context, steps_done: int) -> None:
    files = ctx.trainer.save_checkpoint()
    if ctx.critic is not None:  # the critic's weights and optimizer state beside the actor's
        files.update({f"critic/{name}": data for name, data in ctx.critic.save_checkpoint().items()})
    ctx.writer.write_checkpoint(
        steps_done,
        files,
        {
            "steps_done": steps_done,
            "cursor": ctx.cursor.state(steps_done) if ctx.cursor is not None else None,
            "weight_version": steps_done,
            "seed": ctx.config.seed,
        },
    )


@contextmanager
def timed(state: StepState, key: str):
    start = time.perf_counter()
    yield
    state.metrics[key] = time.perf_counter() - start
