"""rlbench at real model sizes on one GPU: Qwen3 shapes with random weights and the fixture tokenizer.

    python bench/scale.py [--shapes 0.6B,1.7B] [--steps 3] [--new-tokens 256] [--device cuda] [--repeats 2]
                          [--cost-rounds 9] [--no-checkpoint] [--trainer torch|megatron]

For each shape, in one process (deterministic mode, bf16 over fp32 master weights, 8 prompts x 8 samples,
`--new-tokens` new tokens, 4 minibatches):
1. a step of the loop by stage (data .. record), median over `--steps` steps after one warm-up, with the time
   spent inside rlbench's checksum functions (rlbench.rundir.digest, wherever the loop and trainer call them,
   synchronised around each call: an upper bound on their own time) and in the record stage, as shares of the
   step; then a cross-check of what they cost as a step runs them (their work overlapping the GPU's, and anything
   they might slow elsewhere): the train and sync stages over one batch with checksums and with their lane
   computations left out, alternating `--cost-rounds` rounds. On a host whose stage times wander by more than the
   checksums' cost (seen on an H100 host: the same train stage 0.77 to 1.02 s), the quartiles of the rounds'
   differences span zero and the script says the difference is not resolved;
2. generation of the step's 64 requests by the embedded engine (CUDA graphs on, then off) against transformers'
   own `generate` on the same prompts (sampling, the same number of new tokens, no early stop), as tokens/s,
   alternating, and whether the engine's bits are the same with and without its graphs;
3. the train stage against a bare torch training step over the same batch, alternating: the same model, the
   trainer's own fused AdamW over its fp32 masters, the same micro-batches and a PPO-clip loss, without rlbench
   around it (no checksums, no metrics, no recording);
4. one checkpoint (model, masters and AdamW state), which is not part of a step: a run writes one every
   `checkpoint_every` steps.
Prints each figure and the ratios the issue names (checksums+recording share <= 3%, generation >= 5x
`generate`, train <= 1.2x the bare step). The GPU is named in the output.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder is on sys.path, where bench/megatron.py would hide the megatron package
# (a namespace package: a module anywhere on the path wins over it): the folder is there only to import stages.py.
BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(BENCH)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]
from stages import STAGES, sync_device  # noqa: E402

sys.path.pop(0)

import torch  # noqa: E402

from rlbench.config import load_config  # noqa: E402
from rlbench.core import loop  # noqa: E402
from rlbench.core.context import build  # noqa: E402
from rlbench.rundir import digest  # noqa: E402

# Qwen3's published shapes (config.json of Qwen/Qwen3-0.6B, -1.7B, -4B), the vocabulary the fixture tokenizer's.
SHAPES = {
    "fixture": {},  # the fixture model itself: a quick check that the script runs (--device cpu)
    "0.6B": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "1.7B": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "4B": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
}
# Every entry into rlbench's checksum code (rlbench/rundir/digest.py), under the names its callers imported it by:
# nested calls count once (the outermost).
CHECKSUM_FUNCTIONS = ("lanes", "_fetch", "tensors_digest", "tensor_digests", "weights_digest", "weights_digests")
CHECKSUM_METHODS = ("add", "add_all", "hexdigests")  # digest.Digests: the trainer's gradient checksums


def model_dir(root: Path, shape: str) -> Path:
    fixture = json.loads(Path(load_config().model.path, "config.json").read_text())
    directory = root / shape
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**fixture, **SHAPES[shape], "max_position_embeddings": 4096,
                                                       "torch_dtype": "bfloat16"}, indent=1))
    return directory


def shape_config(root: Path, shape: str, device: str, steps: int, new_tokens: int = 256, trainer: str = "torch"):
    """The run every figure here is taken on: `shape` (its config.json written under `root`) with random weights,
    bf16 over fp32 masters, deterministic, 8 prompts x 8 samples x `new_tokens` new tokens, 4 minibatches in
    micro-batches of 16, its run directory under `root`, no checkpoint within `steps`."""
    return load_config(model__path=str(model_dir(root, shape)), model__init="random", model__dtype="bfloat16",
                       device=device, deterministic=True, steps=steps, out=str(root / "run"),
                       data__prompts_per_step=8, rollout__n_samples_per_prompt=8, rollout__max_new_tokens=new_tokens,
                       train__minibatches=4, train__micro_batch_size=16, checkpoint_every=10**6, train__backend=trainer)


class Clock:
    """Seconds spent inside rlbench's checksum functions, wherever they are called from."""

    def __init__(self, device: str):
        self.seconds, self.device, self.depth = 0.0, device, 0
        for module in _holders():
            for name in CHECKSUM_FUNCTIONS:
                if hasattr(module, name):
                    setattr(module, name, self._wrap(getattr(module, name)))
        for name in CHECKSUM_METHODS:
            setattr(digest.Digests, name, self._wrap(getattr(digest.Digests, name)))

    def _wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.depth += 1
            if self.depth == 1:
                sync_device(self.device)
                start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    sync_device(self.device)
                    self.seconds += time.perf_counter() - start
        return timed


def _holders():
    import rlbench.backends.hf_engine as engine
    import rlbench.backends.torch_trainer as trainer
    import rlbench.core.weight_check as weight_check
    import rlbench.rundir.recording as recording

    return [digest, loop, trainer, weight_check, engine, recording]


def step_by_stage(ctx, steps: int, clock: Clock) -> dict:
    rows = []
    for step in range(steps + 1):
        state, times = loop.StepState(step), {}
        clock.seconds = 0.0
        for name, stage in STAGES:
            sync_device(ctx.config.device)
            start = time.perf_counter()
            stage(ctx, state)
            sync_device(ctx.config.device)
            times[name] = time.perf_counter() - start
        times["checksums"] = clock.seconds
        rows.append(times)
    return {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}


@contextlib.contextmanager
def checksums_off():
    """rlbench's checksum code with its lane computations left out (every tensor's lanes taken as zeros; the
    bookkeeping and the host's sha256 over headers stay): a step run so costs what it would without checksums.
    Its checksum strings mean nothing (the engine's equal the trainer's, so the weight check passes)."""
    saved = digest.Digests.add, digest.Digests.add_all

    def add(self, name, tensor, *keys):
        self._keys.update(dict.fromkeys(keys))
        self._entries.append((keys, b"", (0, 0)))

    def add_all(self, items):
        for name, tensor, keys in items:
            add(self, name, tensor, *keys)

    digest.Digests.add, digest.Digests.add_all = add, add_all
    try:
        yield
    finally:
        digest.Digests.add, digest.Digests.add_all = saved


def checksum_cost(ctx, state, rounds: int) -> tuple[float, float, float]:
    """The train and sync stages (where a step's device checksums are: every minibatch's gradients, the exported
    weights, the engine's weights) over `state`'s batch, alternating with checksums and with `checksums_off` (the
    order flipping every round), `rounds` rounds after a warm-up one: (median s with checksums, median without,
    the rounds' differences, sorted). What those checksums cost as a step runs them, their work overlapping the
    GPU's as it does; the checksum clock's synchronised sum over the whole step is an upper bound."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds + 1):
        for on in ((True, False) if r % 2 else (False, True)):
            with contextlib.nullcontext() if on else checksums_off():
                sync_device(ctx.config.device)
                start = time.perf_counter()
                loop.train(ctx, state)
                loop.sync(ctx, state)
                sync_device(ctx.config.device)
            times[on].append(time.perf_counter() - start)
    differences = sorted(a - b for a, b in zip(times[True][1:], times[False][1:]))
    return statistics.median(times[True][1:]), statistics.median(times[False][1:]), differences


def generation(ctx, new_tokens: int, repeats: int = 2) -> dict:
    """tokens/s of the engine (its CUDA graphs on, then off) and of transformers' generate on the step-0 prompts,
    alternating; whether the engine's tokens and log-probs are the same bits with and without its graphs."""
    state = loop.StepState(0)
    loop.data(ctx, state)
    requests = loop.step_requests(ctx, state)
    model = ctx.engine.model
    prompts = [list(r.prompt_ids) for r in requests]
    width = max(map(len, prompts))
    pad = ctx.tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=ctx.config.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=ctx.config.device)
    times = {"engine": [], "eager": [], "generate": []}
    graphs, results, eager = ctx.engine.cuda_graphs, [], []
    for _ in range(repeats + 1):
        for key, on in (("engine", graphs), ("eager", False)):
            ctx.engine.cuda_graphs = on
            sync_device(ctx.config.device)
            start = time.perf_counter()
            got = ctx.engine.generate(requests)
            sync_device(ctx.config.device)
            times[key].append(time.perf_counter() - start)
            if key == "engine":
                results = got
            else:
                eager = got
        ctx.engine.cuda_graphs = graphs
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=attention, do_sample=True, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
        sync_device(ctx.config.device)
        times["generate"].append(time.perf_counter() - start)
    engine_tokens = sum(len(r.output_ids) for r in results)
    same = all(a.output_ids == b.output_ids and a.logprobs == b.logprobs for a, b in zip(results, eager))
    return {"engine_tok_s": engine_tokens / statistics.median(times["engine"][1:]),
            "eager_tok_s": engine_tokens / statistics.median(times["eager"][1:]), "graphs_same_bits": same,
            "generate_tok_s": len(prompts) * new_tokens / statistics.median(times["generate"][1:]),
            "engine_tokens": engine_tokens}


def bare_step(ctx, state):
    """A bare torch training step over `state`'s batch, as a function: the same model, the same micro-batches and
    PPO-clip loss and the trainer's own optimizer (fused AdamW; for a bf16 model over the trainer's fp32 master
    weights, its gradients added into their fp32 gradients after each micro-batch, the masters copied back after
    the step), nothing else: no checksums, no metrics, no recording, no trimming of the batch to its loss tokens.
    Call it with the trainer's hooks off (`masters.detach()`)."""
    from rlbench.core import algo

    trainer, batch, device = ctx.trainer, state.batch, ctx.config.device
    model, optimizer, masters = trainer.model, trainer.optimizer, trainer.masters
    params = list(model.parameters())
    fp32 = list(masters.params.values()) if masters else params
    n, micro = batch.tokens.shape[0], ctx.config.train.micro_batch_size
    per_minibatch = n // ctx.config.train.minibatches

    def bare() -> None:
        model.train()
        for lo in range(0, n, per_minibatch):
            optimizer.zero_grad(set_to_none=True)
            for m in range(lo, lo + per_minibatch, micro):
                index = slice(m, min(m + micro, lo + per_minibatch))
                tokens = batch.tokens[index].to(device)
                logp = algo.token_logprobs(model(input_ids=tokens, use_cache=False).logits, tokens, 1.0)
                mask = batch.loss_mask[index].to(device)
                ratio = torch.exp(logp - batch.old_logprobs[index].to(device))
                adv = batch.advantages[index].to(device)[:, None]
                loss = (torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * mask).sum() / mask.sum()
                (loss * (index.stop - index.start) / per_minibatch).backward()
                if masters:
                    for p, master in zip(params, fp32):
                        master.grad = p.grad.float() if master.grad is None else master.grad.add_(p.grad)
                        p.grad = None
            torch.nn.utils.clip_grad_norm_(fp32, 1.0)
            optimizer.step()
            if masters:
                with torch.no_grad():
                    torch._foreach_copy_(params, fp32)

    return bare


def train_against_bare(ctx, state, repeats: int = 2) -> tuple[float, float, float]:
    """The train stage (`loop.train`: the trainer's step with its checksums) and `bare_step` over the same batch,
    alternating, `repeats` rounds after a warm-up one: (median train stage s, median bare s, median of the
    per-round ratios)."""
    device, masters, bare = ctx.config.device, ctx.trainer.masters, bare_step(ctx, state)
    times = {"train": [], "bare": []}
    for _ in range(repeats + 1):
        for key in ("train", "bare"):
            if masters and key == "bare":
                masters.detach()  # the trainer's hooks off: the bare step adds the gradients itself
            sync_device(device)
            start = time.perf_counter()
            loop.train(ctx, state) if key == "train" else bare()
            sync_device(device)
            times[key].append(time.perf_counter() - start)
            if masters and key == "bare":
                masters.attach()
    ratios = [t / b for t, b in zip(times["train"][1:], times["bare"][1:])]
    return statistics.median(times["train"][1:]), statistics.median(times["bare"][1:]), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.6B,1.7B")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=2, help="timed generations and train/bare rounds (after a warm-up)")
    parser.add_argument("--cost-rounds", type=int, default=9,
                        help="rounds of train + sync with and without the device checksums (after a warm-up): their "
                             "difference is tens of ms in a second's stage, so it needs more rounds than the rest")
    parser.add_argument("--no-checkpoint", action="store_true", help="skip timing a checkpoint (at 4B: ~72 GB to write)")
    parser.add_argument("--trainer", choices=("torch", "megatron"), default="torch",
                        help="megatron: the megatron trainer (one rank, Megatron's bf16 mixed precision); its steps "
                             "by stage and checkpoint only (the engine's figures are the torch runs'; the bare step "
                             "is a transformers model)")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {gpu}; torch {torch.__version__}")
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            config = shape_config(Path(tmp), shape, args.device, args.steps + 10, args.new_tokens, args.trainer)
            ctx = build(config)
            torch_trainer = args.trainer == "torch"
            clock = Clock(args.device)
            stages = step_by_stage(ctx, args.steps, clock)
            step = sum(v for k, v in stages.items() if k != "checksums")
            share = (stages["checksums"] + stages["record"]) / step
            gen = generation(ctx, args.new_tokens, args.repeats) if torch_trainer else None
            state = loop.StepState(args.steps + 1)
            for name, stage in STAGES[:5]:  # data .. logprob: the batch the train stage gets
                stage(ctx, state)
            with_sums, without, differences = checksum_cost(ctx, state, args.cost_rounds)
            cost = statistics.median(differences)
            quartiles = statistics.quantiles(differences, n=4) if len(differences) > 1 else differences * 3
            if torch_trainer:
                trained, bare, train_ratio = train_against_bare(ctx, state, args.repeats)
            checkpoint = "not timed (--no-checkpoint)"
            if not args.no_checkpoint:
                sync_device(args.device)
                start = time.perf_counter()
                loop.checkpoint(ctx, args.steps + 1)  # not a stage of every step: written every checkpoint_every steps
                ctx.writer.flush()
                sync_device(args.device)
                checkpoint = f"{time.perf_counter() - start:.2f} s"
            print(f"{shape} ({args.trainer} trainer): step {step:.2f} s (" +
                  ", ".join(f"{k} {v:.3f}" for k, v in stages.items()) + ")")
            print(f"  checksums + recording: {share * 100:.1f}% of the step (the time inside the checksum functions, "
                  f"synchronised around each call: an upper bound on their own time; issue: <= 3%)")
            verdict = (f"the device checksums cost {cost * 1000:.1f} ms, {cost / step * 100:.1f}% of a step"
                       if quartiles[0] > 0 else "not resolved from zero by these rounds (their quartiles span it)")
            print(f"  cross-check: train + sync over one batch, alternating {args.cost_rounds} rounds, with checksums "
                  f"{with_sums:.3f} s, with their lane computations left out {without:.3f} s: the rounds' differences "
                  f"median {cost * 1000:.1f} ms, quartiles {quartiles[0] * 1000:.1f} .. {quartiles[2] * 1000:.1f} ms: "
                  f"{verdict} (the share above bounds the checksums' own time; this catches what they cost elsewhere)")
            print(f"  a checkpoint (model + AdamW state, written every checkpoint_every steps): {checkpoint}")
            if not torch_trainer:
                ctx.writer.close()
                ctx.trainer.close()
                continue
            print(f"  generation: engine {gen['engine_tok_s']:.0f} tok/s, transformers generate "
                  f"{gen['generate_tok_s']:.0f} tok/s: x{gen['engine_tok_s'] / gen['generate_tok_s']:.2f} "
                  f"(issue: >= 5); without CUDA graphs {gen['eager_tok_s']:.0f} tok/s; graphs and eager the same "
                  f"bits: {gen['graphs_same_bits']}")
            print(f"  train stage {trained:.3f} s vs a bare torch step {bare:.3f} s over the same batch, alternating "
                  f"{args.repeats} rounds: x{train_ratio:.2f} (median of the rounds' ratios; issue: <= 1.2)")
            ctx.writer.close()
            del ctx
            torch.cuda.empty_cache() if args.device.startswith("cuda") else None


if __name__ == "__main__":
    main()
