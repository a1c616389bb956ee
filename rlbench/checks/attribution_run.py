"""The states of `check logprobs --attribute` (checks/attribution.py) for an rlbench run: what computes each.

    decode      the recording's rollout_logprobs
    engine      the embedded engine (`--rollout hf`): its model in its dtype (rollout.dtype) holding its weights as it
                loads them (cast, or quantized: rollout.quantization), one forward over the whole sequence at batch
                size 1 with no cache, read the engine's way (rollout.logprobs); or, given `engine_url`, the user's
                SGLang server (or `rlbench serve`) through its native API (checks/attribution_http.py)
    forward     the trainer's model code (transformers', as the torch trainer runs it), the same weights and dtype
    dtype       the trainer's model in the trainer's dtype, the trainer's weights of the engine's version
    weights     the same, the trainer's weights of the step (checkpoint s holds the weights before step s)
    micro_batch the trainer's log-prob pass as the run's logprob stage ran it (its micro-batches, or one sample at a
                time under true on-policy)
    definition  the same logits read the trainer's way (algo.token_logprobs), rounded to float32 as recorded
    recorded    the recording's old_logprobs (a rollout-only run has none)

Weights of version v: checkpoint v's model.safetensors, or for version 0 the model the run was built from (held to
the initial weights' digest the run recorded). A version without either leaves the states that need it not
measured. The embedded engine runs the trainer's model code, so `forward` is `engine`'s values there, and a state
whose inputs equal its predecessor's is its values (attribution.StepStates.same says which and why): an unchanged
default run computes two passes, one sample at a time (engine) and as trained (micro_batch).

A megatron-core trainer's forward is not rerun here: the trainer-side states are not measured for such a run.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlbench.backends.engine_numerics import DTYPES
from rlbench.checks.attribution import Attribution, StepStates, attribute
from rlbench.checks.attribution_weights import Weights, ModelCopy, initial_weights, skeleton
from rlbench.checks.logprobs import judged_samples, sample_nuclei
from rlbench.errors import BadInput
from rlbench.rundir import recording


@dataclass(frozen=True)
class EngineNumerics:
    """How the engine's numbers differ from the trainer's by its settings."""

    dtype: str  # the engine's compute and weight dtype
    quantization: str  # "none" or "fp8" (block-wise e4m3, as slime's fp8 rollouts)
    logprobs: str  # "full": log_softmax(logits / T); "filtered": renormalised over what top-k/top-p keep
    temperature: float
    top_k: int
    top_p: float

    @classmethod
    def of(cls, config) -> EngineNumerics:
        """The run's: the embedded engine's settings, or for SGLang servers rlbench started their --dtype (where
        not "auto": the model's)."""
        rollout = config.rollout
        server_dtype = rollout.sglang.get("dtype") if rollout.backend == "sglang" else None
        return cls(
            rollout.dtype or (server_dtype if server_dtype in DTYPES else None) or config.model.dtype,
            rollout.quantization,
            rollout.logprobs,
            rollout.temperature,
            rollout.top_k,
            rollout.top_p,
        )


def engine_logprobs(logits: torch.Tensor, ids: torch.Tensor, numerics: EngineNumerics) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from logits [L, V] of positions 0..L-1, read the engine's way: the
    log-softmax of logits.float() / T (T 0: greedy, read at 1), renormalised over the tokens top-k and top-p keep
    where rollout.logprobs is "filtered" (sampling.filtered_logprobs). [L] float64 on the logits' device (no wait for
    the device here: a pass's forwards queue up), position 0 gets 0."""
    from rlbench.backends.sampling import filtered_logprobs

    t = numerics.temperature if numerics.temperature > 0 else 1.0
    logp = torch.log_softmax(logits[:-1].float() / t, dim=-1)
    targets = ids[1:].to(logp.device)
    if numerics.logprobs == "filtered" and numerics.temperature > 0:
        picked = filtered_logprobs(logp, targets, numerics.top_k, numerics.top_p)
    else:
        picked = logp.gather(-1, targets[:, None]).squeeze(-1)
    return torch.cat([picked.new_zeros(1), picked]).double()


def _alone_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of one sequence at batch size 1, no cache: the call algo.sequence_logprobs makes."""
    with torch.no_grad():
        return model(input_ids=ids[None].to(model.device), use_cache=False).logits[0]


class RunStates:
    """Computes a step's states (the module docstring) for one run."""

    def __init__(self, run, config, device: str = "cpu"):
        from rlbench.backends.torch_trainer import TorchTrainer

        self.run, self.config = run, config
        self.numerics = EngineNumerics.of(config)
        self.trainer_dtype = config.model.dtype
        model = skeleton(config.model.path)
        self.weights = Weights(run, lambda: initial_weights(run, config))
        self.megatron = config.train.backend == "megatron"
        self.rollout_only = run.manifest.get("mode") == "rollout-only"
        self.device = device
        # one model per dtype (a copy of a real size costs seconds): the engine's where it computes in another
        engine_model = copy.deepcopy(model) if self.numerics.dtype != self.trainer_dtype else None
        trainer_model = model.to(DTYPES[self.trainer_dtype])
        self.trainer = TorchTrainer(
            trainer_model, config.train, config.algo, config.rollout.temperature, config.seed, device
        )
        self.forward_seconds = 0.0  # the forwards' time, the device synchronised (bench/attribution.py reads it)
        self.alone = [0.0, 0]  # of which the samples-alone forwards: seconds, forwards
        self.scorer = None  # an HTTP server's (attribution_http.ServerScorer); None: the embedded engine, here
        self.trainer_alone = ModelCopy(self.trainer.model, self.trainer_dtype, device)
        engine = None if engine_model is None else ModelCopy(engine_model, self.numerics.dtype, device)
        self.engine = engine or self.trainer_alone
        self.cast = self.numerics.dtype != self.trainer_dtype or self.numerics.quantization != "none"
        # uncast, the engine holds the trainer's weights as they are (one model): named so, they are not loaded again
        self.held_kind = "held" if self.cast else "own"
        self.asked: dict[int, tuple] = {}  # version -> what the server holds of it (`_server`)
        self.imported = "imported" in run.manifest  # a slime dump (rlbench import slime): no engine, no checkpoints
        self.nuclei: list = []

    def held(self, version: int) -> dict[str, torch.Tensor]:
        """The engine's weights of `version` as it loads them (engine_numerics.held_form)."""
        from rlbench.backends.engine_numerics import held_form

        weights = {name: tensor.to(self.device) for name, tensor in self.weights.get(version).items()}
        return held_form(weights, DTYPES[self.numerics.dtype], self.numerics.quantization)  # cast on the device

    def step(self, step: int) -> StepStates:
        tensors, meta = recording.read_step(self.run.root, step)
        samples = meta["samples"]
        judged, _, _ = judged_samples(samples)
        offsets = tensors["offsets"]
        mask = tensors["loss_mask"].bool().clone()
        for i in (i for i, ok in enumerate(judged) if not ok):
            mask[int(offsets[i]) : int(offsets[i + 1])] = False
        index = mask.nonzero().squeeze(-1)
        sample_of = torch.searchsorted(offsets, index, right=True) - 1
        position = index - offsets[sample_of] - tensors["prompt_lengths"][sample_of]
        out = StepStates(step, torch.stack([sample_of, position, tensors["tokens"][index]], dim=1))
        out.put("decode", tensors["rollout_logprobs"][index])
        if "old_logprobs" in tensors:
            out.put("recorded", tensors["old_logprobs"][index])
        elif self.rollout_only:
            out.reasons["recorded"] = "a rollout-only run records no trainer log-probs"
        else:  # a full run's step without them: PPO's critic-only steps
            out.reasons["recorded"] = "a PPO critic-only step: the actor computed no log-probs"
        bounds = offsets.tolist()
        ids = [tensors["tokens"][bounds[i] : bounds[i + 1]] for i in range(len(samples))]
        rows = [i for i, ok in enumerate(judged) if ok]
        # an imported slime dump's samples were drawn with the weights given to the import (its model), version 0
        versions = [0 if self.imported else int(s.get("weight_version", 0)) for s in samples]
        self.nuclei = [sample_nuclei(tensors, b, c) if s.get("top_p") else None for s, b, c in _spans(samples, tensors)]
        flat = lambda per_sample: _flat(per_sample, bounds, index)  # noqa: E731
        missing = sorted({versions[i] for i in rows if not self.weights.has(versions[i])})
        no_weights = f"no checkpoint of weight version(s) {missing} (checkpoint_every = 1 keeps every version)"

        if self.scorer is not None:
            out.put("engine", *flat(self.scorer.score(ids, tensors["prompt_lengths"].tolist(), rows, versions, out)))
        elif self.imported:
            out.reasons["engine"] = "a slime dump holds no engine to ask (--engine-url asks a server)"
        else:
            out.put("engine", *flat(self._alone(self.engine, ids, rows, lambda i: (self.held_kind, versions[i]))))
            if missing:
                out.reasons["engine"] = no_weights
        if self.megatron:
            for state in ("forward", "dtype", "weights", "micro_batch", "definition"):
                out.reasons[state] = "the trainer is megatron-core: its forward is not rerun here"
            return out
        if self.scorer is None and not self.imported:
            self._same(out, "forward", "engine", "the embedded engine runs the trainer's model code: one computation")
            damaged = set()
        else:
            held = self.held_kind if self.scorer is None else "server"
            out.put("forward", *flat(self._alone(self.engine, ids, rows, lambda i: (held, versions[i]))))
            damaged = {versions[i] for i in rows if self.weights.has(versions[i]) and self._server(versions[i])[1]}
            self._server_notes(sorted({versions[i] for i in rows if self.weights.has(versions[i])}), out)
        if not self.cast and "forward" in out.values and not damaged:
            self._same(
                out, "dtype", "forward", f"the engine computes in the trainer's {self.trainer_dtype}, unquantized"
            )
        else:  # the trainer's weights of the version, but a tensor the server holds otherwise stays the server's
            kinds = {v: "mixed" if v in damaged else "own" for v in versions}
            out.put(
                "dtype", *flat(self._alone(self.trainer_alone, ids, rows, lambda i: (kinds[versions[i]], versions[i])))
            )
        if missing:
            out.reasons.update(forward=no_weights, dtype=no_weights)
        version = 0 if self.rollout_only else step  # an imported dump is rollout-only: the import's model
        if not self.weights.has(version):
            reason = f"no checkpoint of weight version {version}, the step's (checkpoint_every = 1 keeps every one)"
            out.reasons.update(weights=reason, micro_batch=reason, definition=reason)
            return out
        if all(versions[i] == version for i in rows) and not damaged:
            why = "one model, given to the import" if self.imported else "the engine sampled with the weights trained"
            self._same(out, "weights", "dtype", why)
        else:
            out.put("weights", *flat(self._alone(self.trainer_alone, ids, rows, lambda i: ("own", version))))
        self._as_trained(tensors, meta, version, index, out)
        return out

    @staticmethod
    def _same(out: StepStates, state: str, before: str, why: str) -> None:
        out.put(state, out.values[before], out.measured[before])
        out.same[state] = f"{state} = {before}: {why}"

    def _timed(self, fn, *args):
        """fn(*args), its time (device synchronised) added to forward_seconds less the weights read within it; without
        deterministic mode's NaN fills (batched_forward.without_nan_fill: forwards write every tensor they read)."""
        from rlbench.backends.batched_forward import without_nan_fill

        read = self.weights.seconds
        _sync(self.device)
        start = time.perf_counter()
        try:
            with without_nan_fill():
                return fn(*args)
        finally:
            _sync(self.device)
            self.forward_seconds += time.perf_counter() - start - (self.weights.seconds - read)

    def _alone(self, holder: ModelCopy, ids, rows, key) -> list[torch.Tensor | None]:
        before = self.forward_seconds
        out = self._timed(self._alone_pass, holder, ids, rows, key)
        self.alone[0] += self.forward_seconds - before
        self.alone[1] += sum(part is not None for part in out)
        return out

    def _alone_pass(self, holder: ModelCopy, ids, rows, key) -> list[torch.Tensor | None]:
        """Per judged sample whose weights exist, its log-probs read the engine's way at batch size 1 in `holder`,
        loaded with the weights `key(i)` names: ("held", v), the engine's of version v; ("own", v), the trainer's."""
        out: list[torch.Tensor | None] = [None] * len(ids)
        wanted = [i for i in rows if self.weights.has(key(i)[1])]
        for i in sorted(wanted, key=lambda i: key(i)[1]):  # each weight set loaded once
            model = holder.load(key(i), self._weights_of)
            out[i] = self._engine_way(_alone_logits(model, ids[i]), ids[i], i)
        return [None if part is None else part.cpu() for part in out]  # one wait, after the pass's last forward

    def _engine_way(self, logits: torch.Tensor, ids: torch.Tensor, i: int) -> torch.Tensor:
        """Sample i's log-probs read the engine's way: over its recorded top-p nucleus where it has one (an imported
        slime sample: SGLang reported them renormalised over it), else `engine_logprobs`."""
        if self.nuclei[i] is None:
            return engine_logprobs(logits, ids, self.numerics)
        prompt = len(ids) - len(self.nuclei[i])
        return _nucleus_way(logits, ids, prompt, self.nuclei[i], self.numerics.temperature)

    def _weights_of(self, key: tuple[str, int]) -> dict[str, torch.Tensor]:
        """held: the engine's copy of version v; own: the trainer's; server: what the server holds of v (where its
        hashes tell; else the engine's copy); mixed: the trainer's, but the tensors the server holds otherwise."""
        kind, version = key
        if kind == "held":
            return self.held(version)
        if kind == "server":
            return self._server(version)[0]
        own = self.weights.get(version)
        if kind == "own":
            return own
        server, differ, _ = self._server(version)
        return {name: server[name].to(own[name].dtype) if name in differ else tensor for name, tensor in own.items()}

    def _server(self, version: int) -> tuple[dict[str, torch.Tensor], list[str], str]:
        """What the server holds of `version` (attribution_http.held_weights), asked once a version: its weights,
        the tensors that differ from the engine's copy of it, and why it could not be told ("" where it could)."""
        if self.scorer is None:
            return self.held(version), [], "no server"
        if version not in self.asked:
            expected = self.held(version)
            got, differ, why = self.scorer.held_weights(expected)
            self.asked[version] = (got if got is not None else expected, differ, why)
        return self.asked[version]

    def _server_notes(self, versions: list[int], out: StepStates) -> None:
        for version in versions:
            _, differ, why = self._server(version)
            if why and why != "no server":
                out.notes.append(
                    f"forward: the server's weights of version {version} are the engine's copy of the trainer's, "
                    f"unchecked: {why}; what it holds otherwise shows in kernels"
                )
            elif not differ:
                out.notes.append(
                    f"forward: the server's weights of version {version} checked equal, tensor by tensor, to the "
                    "engine's copy of the trainer's (its /weights_checker hashes)"
                )
            else:
                out.notes.append(
                    f"forward: the server holds {len(differ)} tensor(s) of version {version} otherwise than the "
                    f"trainer's cast: {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''} (in forward and dtype "
                    "as the server holds them; weights puts the trainer's back)"
                )

    def _as_trained(self, tensors, meta, version: int, index, out: StepStates) -> None:
        self._timed(self._as_trained_pass, tensors, meta, version, index, out)

    def _as_trained_pass(self, tensors, meta, version: int, index, out: StepStates) -> None:
        """micro_batch and definition: the logprob stage's pass, with the trainer's weights of `version`."""
        from rlbench.core import algo
        from rlbench.core.samples import train_batch

        trainer = self.trainer
        self.trainer_alone.load(("own", version), self._weights_of)  # the trainer's model: its alone forwards' too
        batch = train_batch({**tensors, "advantages": torch.zeros(tensors["rewards"].shape)})
        tokens, lengths = batch.tokens, batch.lengths
        dp_shards = meta.get("dp_shards") or []
        trained = [False] * tokens.shape[0]
        engine_way = torch.zeros(tokens.shape, dtype=torch.float64)
        trainer_way = torch.zeros(tokens.shape, dtype=torch.float32)
        per_sample = self.config.rollout.true_on_policy
        trim = per_sample or self.imported or self.config.train.max_tokens_per_micro_batch is not None
        if per_sample:
            groups = [[i] for i in range(tokens.shape[0])]
        elif self.imported:  # the train dump's micro-batches, rank by rank (rows: positions in the rollout)
            groups = [[shard["partition"][j] for j in mb] for shard in dp_shards for mb in shard["micro_batch_indices"]]
        else:
            groups = [list(mb) for mb in trainer.train_micro_batches(lengths.tolist())]
        with torch.no_grad():
            for rows in groups:
                r = torch.as_tensor(rows)
                width = int(lengths[r].max()) if trim else tokens.shape[1]
                ids = tokens[r, :width].to(self.device)
                logits = trainer.model_logits(trainer.model, ids)
                # recorded as float32, as the logprob stage records them
                trainer_way[r, :width] = algo.token_logprobs(logits, ids, self.config.rollout.temperature).float().cpu()
                for j, row in enumerate(rows):
                    n = int(lengths[row])
                    engine_way[row, :n] = self._engine_way(logits[j, :n], ids[j, :n], row)
                    if self.nuclei[row] is not None:  # slime's trainer reads it over the same nucleus
                        trainer_way[row, :n] = engine_way[row, :n].float()
                    trained[row] = True
        offsets = tensors["offsets"]
        if not all(trained):  # a dump's trailing samples slime's schedule dropped: in no micro-batch
            out.reasons.update(micro_batch="not trained (in no micro-batch of the train dump)")
        measured = recording.unpad(torch.tensor(trained)[:, None].expand(tokens.shape), offsets)[index]
        out.put("micro_batch", recording.unpad(engine_way, offsets)[index], measured)
        out.put("definition", recording.unpad(trainer_way, offsets)[index], measured)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _spans(samples: list[dict], tensors: dict) -> list[tuple[dict, int, int]]:
    """(sample, its response's first flat position, its end) per sample."""
    offsets, prompts = tensors["offsets"].tolist(), tensors["prompt_lengths"].tolist()
    return [(s, offsets[i] + prompts[i], offsets[i + 1]) for i, s in enumerate(samples)]


def _nucleus_way(logits: torch.Tensor, ids: torch.Tensor, prompt: int, nuclei, temperature: float) -> torch.Tensor:
    """Full-length log-probs of one sequence's response renormalised over its recorded nucleus (logprobs.py's, as
    slime's trainer and its engine read them), 0 over the prompt."""
    from rlbench.checks.logprobs import response_nucleus_logprobs

    out = torch.zeros(len(ids), dtype=torch.float64)
    out[prompt:] = response_nucleus_logprobs(logits, ids, prompt, nuclei, temperature).double()
    return out


def _flat(per_sample: list[torch.Tensor | None], bounds: list[int], index: torch.Tensor):
    """Per-sample full-length vectors (None: not computed) as (values, measured) at the flat judged `index`."""
    values, measured = [], []
    for i, part in enumerate(per_sample):
        n = bounds[i + 1] - bounds[i]
        values.append(part if part is not None else torch.zeros(n, dtype=torch.float64))
        measured.append(torch.full((n,), part is not None, dtype=torch.bool))
    if not values:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
    return torch.cat(values)[index], torch.cat(measured)[index]


def attribute_run(
    run_dir: str | Path,
    steps: list[int] | None = None,
    top: int = 10,
    engine_url: str | None = None,
    load_weights: bool = False,
    device: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Attribution, dict]:
    """The attribution of a run's mismatch (its committed steps, or `steps`), and what it was measured with."""
    from rlbench.core.context import check_made_with
    from rlbench.replay.integrity import open_run
    from rlbench.replay.replay import source_config

    # checkpoints seen whole here; each one's weights held to the run's checksum when read (`Weights.get`)
    run = open_run(run_dir, recordings="verify", checkpoints="present", need_steps=True, need_recordings=True).run
    config = source_config(run)
    check_made_with(run, tokenizer=config.model.tokenizer, model=config.model.path)
    device = device or config.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(
            f"the run ran on {device}, which this machine has not: --device cpu attributes it here", field="--device"
        )
    from rlbench.core.seeding import configure_determinism

    configure_determinism(config.threads, device, config.deterministic)  # the run's threads and algorithms
    states = RunStates(run, config, device)
    if engine_url is not None:
        from rlbench.checks.attribution_http import ServerScorer

        loader = (states.weights.get, Path(config.model.path) / "config.json") if load_weights else None
        states.scorer = ServerScorer(engine_url, states.numerics, loader)
    elif load_weights:
        raise BadInput("only with --engine-url", field="--engine-load-weights")
    wanted = run.steps if steps is None else [s for s in run.steps if s in set(steps)]
    if not wanted:
        raise BadInput(
            f"undetermined: none of the steps asked for is committed (the run committed {len(run.steps)})",
            field="--steps",
        )
    computed, began = [], time.perf_counter()
    try:
        for k, step in enumerate(wanted):
            if k + 1 < len(wanted) and not states.rollout_only:  # the next step's weights read while this one runs
                states.weights.prefetch(wanted[k + 1])
            computed.append(states.step(step))
            if progress is not None:
                progress(k + 1, len(wanted))
    finally:
        states.weights.close()
        if states.scorer is not None:
            states.scorer.close()
    if not sum(step.tokens() for step in computed):
        raise BadInput(
            "undetermined: no judged token to attribute (every sample removed, without engine log-probs, or "
            "without trained tokens)",
            path=run.root,
        )
    numerics = states.numerics
    context = {
        "run": str(run.root),
        "steps": wanted,
        "engine": engine_url
        or ("none (a slime dump)" if states.imported else "")
        or f"embedded hf engine ({numerics.dtype}, quantization {numerics.quantization}, "
        f"log-probs {numerics.logprobs})",
        "device": device,
        # where the time went: reading each version's weights, the forwards (the rest: reading the recording)
        "seconds": {
            "steps": time.perf_counter() - began,
            "weights": states.weights.seconds,
            "forwards": states.forward_seconds,
            "alone": states.alone[0],  # of the forwards, those of one sample each (`alone_forwards` of them)
        },
        "alone_forwards": states.alone[1],
        "trainer": f"slime's, as recorded; recomputed with the transformers forward of {config.model.path} "
        f"({states.trainer_dtype}) in the train dump's micro-batches"
        if states.imported
        else f"{config.train.backend} trainer ({states.trainer_dtype})",
    }
    return attribute(computed, top), context
