"""rlbench at real model sizes on one GPU: Qwen3 shapes with random weights, Qwen3's vocabulary (151,936 logits)
and a tokenizer of Qwen3's size (151,669 ids: the fixture tokenizer grown with filler tokens, built here offline).

    python bench/scale.py [--shapes 0.6B,1.7B] [--steps 3] [--new-tokens 256] [--device cuda] [--repeats 2]
                          [--cost-rounds 9] [--no-checkpoint] [--trainer torch|megatron] [--vocab 151936|fixture]
                          [--peer trl|none] [--peer-rounds 3] [--peer-repeats 2] [--only-peer]
                          [--peer-runs det,free,memory]

0. With `--peer trl` (needs trl): the step against TRL's GRPOTrainer, each as its users run it, in processes of
   their own, alternating `--peer-repeats` times: TRL with its own defaults (GRPOConfig's; the batch shape set to
   the same 8 prompts x 8 samples, `--new-tokens` new tokens, 4 optimizer steps of 16, beta 0) on the same
   weights (saved once as safetensors, bf16 or with `--peer-weights fp32` float32, which TRL loads as saved),
   `rlbench run --device cuda` with and without `--deterministic`.
   `--peer none`: the rlbench processes only (deterministic mode's cost). `--peer-runs` chooses them (default
   det,free): `det` deterministic, `free` not, `memory` deterministic with slime's memory settings (layers
   recomputed, the optimizer in host memory, the engine's memory let go of between rollouts: docs/usage.md
   "Memory").
   Each runs `--peer-rounds` steps after one warm-up; per process the step's median and the peak memory
   allocated (torch.cuda.max_memory_allocated). Beside them the physical floor of each stage on this card:
   the rollout's (the weights and the KV cache read once per decode step at the card's memory bandwidth), the
   log-prob pass's (2 x params x tokens at its dense bf16 rate) and the train stage's (6 x params x tokens,
   plus AdamW's fp32 state read and written once).

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
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder is on sys.path, where bench/megatron.py would hide the megatron package
# (a namespace package: a module anywhere on the path wins over it): the folder is there only to import stages.py.
BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(BENCH)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]
from peer_trl import TRL_WORKER  # noqa: E402  (TRL's GRPOTrainer in a process of its own)
from stages import STAGES, sync_device  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]  # peer_trl.py puts the folder there too

import torch  # noqa: E402

from rlbench.config import load_config  # noqa: E402
from rlbench.core import loop  # noqa: E402
from rlbench.session import build  # noqa: E402
from rlbench.rundir import digest  # noqa: E402

QWEN3_VOCAB, QWEN3_TOKENIZER = 151_936, 151_669  # Qwen3's config.json vocab_size; its tokenizer's ids (len(tokenizer))
# The cards' published peaks: memory bandwidth (B/s) and dense bf16 tensor rate (FLOP/s), SXM parts.
CARDS = {"H100": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}
# Qwen3's published shapes (config.json of Qwen/Qwen3-0.6B, -1.7B, -4B).
SHAPES = {
    "fixture": {},  # the fixture model itself: a quick check that the script runs (--device cpu)
    "0.6B": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "1.7B": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
    "4B": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
    },
}
# Every entry into rlbench's checksum code (rlbench/rundir/digest.py), under the names its callers imported it by:
# nested calls count once (the outermost).
CHECKSUM_FUNCTIONS = ("lanes", "_fetch", "tensors_digest", "tensor_digests", "weights_digest", "weights_digests")
CHECKSUM_METHODS = ("add", "add_all", "hexdigests")  # digest.Digests: the trainer's gradient checksums


def model_dir(root: Path, shape: str, vocab: int | None = None) -> Path:
    """`shape`'s config.json under root/shape; `vocab` its vocab_size (None: the fixture's)."""
    fixture = json.loads(Path(load_config().model.path, "config.json").read_text())
    directory = root / shape
    directory.mkdir()
    sized = {"vocab_size": vocab} if vocab else {}
    (directory / "config.json").write_text(
        json.dumps(
            {**fixture, **SHAPES[shape], **sized, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}, indent=1
        )
    )
    return directory


def real_tokenizer(root: Path, size: int = QWEN3_TOKENIZER) -> Path:
    """The fixture tokenizer grown to `size` ids, written under root/tokenizer: its BPE vocabulary, merges, special
    tokens and chat template, then filler tokens `zzfill<N>` (letters and digits: byte-level characters, so each
    decodes to its own text) up to `size`. The prompts encode as with the fixture tokenizer; every id decodes."""
    source = Path(load_config().model.tokenizer)
    spec = json.loads((source / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    start = max(vocab.values()) + 1
    vocab.update({f"zzfill{i}": i for i in range(start, size)})
    directory = root / "tokenizer"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    (directory / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text())
    return directory


def shape_config(
    root: Path,
    shape: str,
    device: str,
    steps: int,
    new_tokens: int = 256,
    trainer: str = "torch",
    vocab: int | None = QWEN3_VOCAB,
):
    """The run every figure here is taken on: `shape` (its config.json written under `root`, `vocab` logits, with a
    tokenizer of Qwen3's size; None: the fixture's vocabulary and tokenizer) with random weights, bf16 over fp32
    masters, deterministic, 8 prompts x 8 samples x `new_tokens` new tokens, 4 minibatches in micro-batches of 16,
    its run directory under `root`, no checkpoint within `steps`."""
    tokenizer = str(real_tokenizer(root)) if vocab else load_config().model.tokenizer
    return load_config(
        model__path=str(model_dir(root, shape, vocab)),
        model__init="random",
        model__dtype="bfloat16",
        model__tokenizer=tokenizer,
        device=device,
        deterministic=True,
        steps=steps,
        out=str(root / "run"),
        data__prompts_per_step=8,
        rollout__n_samples_per_prompt=8,
        rollout__max_new_tokens=new_tokens,
        train__minibatches=4,
        train__micro_batch_size=16,
        checkpoint_every=10**6,
        train__backend=trainer,
    )


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


def step_by_stage(ctx, steps: int, clock: Clock) -> tuple[dict, dict]:
    """Each stage's median seconds over `steps` steps after a warm-up (and the checksums' time), and on a GPU each
    stage's peak memory allocated over all of them (GiB; what the stage allocates on top of what it finds held)."""
    rows, peaks = [], {}
    cuda = ctx.config.device.startswith("cuda")
    for step in range(steps + 1):
        state, times = loop.StepState(step), {}
        clock.seconds = 0.0
        for name, stage in STAGES:
            sync_device(ctx.config.device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            stage(ctx, state)
            sync_device(ctx.config.device)
            times[name] = time.perf_counter() - start
            if cuda:
                peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        times["checksums"] = clock.seconds
        rows.append(times)
    return {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}, peaks


def _held_memory(ctx) -> dict[str, float]:
    """What a torch-trainer run holds on the GPU between steps, by part (GiB): the trainer's model, its fp32
    masters and their gradients, AdamW's moments, the engine's model; the rest is what else is allocated then."""

    def size(tensors) -> float:
        return sum(t.numel() * t.element_size() for t in tensors) / 2**30

    trainer, held = ctx.trainer, {}
    if hasattr(trainer, "model"):
        held["trainer model"] = size(trainer.model.parameters())
        if getattr(trainer, "masters", None):
            masters = list(trainer.masters.params.values())
            held["fp32 masters"] = size(masters)
            held["master grads"] = size(p.grad for p in masters if p.grad is not None)
        held["AdamW moments"] = size(
            v
            for state in trainer.optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
    model = getattr(ctx.engine, "model", None)
    if isinstance(model, torch.nn.Module):
        held["engine model"] = size(model.parameters())
    held["all allocated"] = torch.cuda.memory_allocated() / 2**30
    return held


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
        for on in (True, False) if r % 2 else (False, True):
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
            model.generate(
                input_ids=ids,
                attention_mask=attention,
                do_sample=True,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=pad,
            )
        sync_device(ctx.config.device)
        times["generate"].append(time.perf_counter() - start)
    engine_tokens = sum(len(r.output_ids) for r in results)
    same = all(a.output_ids == b.output_ids and a.logprobs == b.logprobs for a, b in zip(results, eager))
    return {
        "engine_tok_s": engine_tokens / statistics.median(times["engine"][1:]),
        "eager_tok_s": engine_tokens / statistics.median(times["eager"][1:]),
        "graphs_same_bits": same,
        "generate_tok_s": len(prompts) * new_tokens / statistics.median(times["generate"][1:]),
        "engine_tokens": engine_tokens,
    }


def time_checkpoint(ctx, steps_done: int, device: str) -> str:
    """One checkpoint as a run makes it (loop.checkpoint), in its two parts: the trainer's files made in memory
    (this blocks the step), then written by the run directory's background writer (the step goes on), timed to
    the write's end; then the disk alone, the same number of bytes written and fsynced in 64 MiB blocks into the
    run directory, for the write's floor on this machine."""
    import os

    sync_device(device)
    start = time.perf_counter()
    files = ctx.trainer.save_checkpoint()
    made = time.perf_counter() - start
    start = time.perf_counter()
    ctx.writer.write_checkpoint(
        steps_done,
        files,
        {"steps_done": steps_done, "cursor": None, "weight_version": steps_done, "seed": ctx.config.seed},
    )
    ctx.writer.flush()
    written = time.perf_counter() - start
    size = sum(len(data) for data in files.values())
    del files
    block, path = bytes(64 << 20), Path(ctx.config.out) / "disk-probe"
    start = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(0, size, len(block)):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    disk = time.perf_counter() - start
    path.unlink()
    return (
        f"{made + written:.2f} s for {size / 1e9:.2f} GB: made in memory {made:.2f} s (blocks the step), written "
        f"{written:.2f} s by the background writer (x{written / disk:.2f} of this disk's own {disk:.2f} s for the "
        f"same bytes, {size / disk / 1e9:.2f} GB/s)"
    )


def _data(ctx):
    state = loop.StepState(0)
    loop.data(ctx, state)
    return state


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


RLBENCH_WORKER = r"""
import json, sys
import torch
from rlbench.cli import main
sys.argv = ["rlbench", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    if exc.code:
        raise
print(json.dumps({"peak": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0}))
"""


def parameters(config: dict) -> int:
    """A Qwen3 config's parameter count (tied embeddings counted once)."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    attention = h * q + 2 * h * kv + q * h + 2 * config["head_dim"]  # q, k, v, o and the q/k norms
    layer = attention + 3 * h * config["intermediate_size"] + 2 * h
    return vocab * h * (1 if config.get("tie_word_embeddings") else 2) + layers * layer + h


def floors(config: dict, prompt: int, new: int, samples: int, card: str) -> dict:
    """Seconds each stage cannot beat on `card` (CARDS): the rollout reads the bf16 weights and the KV cache
    written so far once per decode step; the log-prob pass computes 2 x params x tokens, the train stage
    6 x params x tokens plus AdamW's fp32 state (masters, two moments, gradients, bf16 copy: 26 bytes a parameter)
    read and written once."""
    bandwidth, rate = CARDS[card]
    params = parameters(config)
    kv_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2  # bf16 K, V
    rollout = sum(2 * params + samples * (prompt + t) * kv_token for t in range(new)) / bandwidth
    tokens = samples * (prompt + new)
    return {
        "params": params,
        "rollout": rollout,
        "logprob": 2 * params * tokens / rate,
        "train": 6 * params * tokens / rate + 26 * params / bandwidth,
    }


PEER_WEIGHTS = {"bf16": "bfloat16", "fp32": "float32"}  # --peer-weights: the saved dtype


def peer_trl(args, shape: str, root: Path) -> None:
    """TRL's GRPOTrainer and `rlbench run` (deterministic and not), each in its own process, alternating."""
    import os
    import subprocess

    from safetensors.torch import save_file

    from rlbench.core.model import build_model, load_tokenizer, named_weights

    vocab = None if args.vocab == "fixture" else int(args.vocab)
    directory = model_dir(root, shape, vocab)
    tokenizer = real_tokenizer(root) if vocab else Path(load_config().model.tokenizer)
    model = build_model(str(directory), 1234, init="random").to(getattr(torch, PEER_WEIGHTS[args.peer_weights]))
    # the checkpoint's config says its dtype, as a saved float32 model's does: transformers loads "auto" from it
    config_file = directory / "config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "torch_dtype": PEER_WEIGHTS[args.peer_weights]}, indent=1)
    )
    save_file({k: v.contiguous() for k, v in named_weights(model).items()}, str(directory / "model.safetensors"))
    del model
    data = load_config().data.path
    config = {
        "steps": args.peer_rounds + 1,
        "checkpoint_every": 10**6,
        "device": args.device,
        "model": {"path": str(directory), "tokenizer": str(tokenizer), "dtype": "bfloat16", "init": "checkpoint"},
        "data": {"prompts_per_step": 8},
        "rollout": {"n_samples_per_prompt": 8, "max_new_tokens": args.new_tokens},
        "train": {"minibatches": 4, "micro_batch_size": 16},
    }
    tomls = {}  # run name: its config file
    for key in args.peer_runs.split(","):
        name, overrides = PEER_RUNS[key]
        merged = {**config, **({"threads": min(16, os.cpu_count() or 1)} if key == "memory" else {})}
        for section, values in overrides.items():
            merged[section] = {**config[section], **values}
        tomls[name] = root / f"peer-{key}.toml"
        tomls[name].write_text(_toml(merged))
    results: dict[str, list] = {"TRL GRPOTrainer": []}
    results.update({PEER_RUNS[key][0]: [] for key in args.peer_runs.split(",")})
    if args.peer == "none":  # deterministic mode's cost alone, as `rlbench run` processes measure it
        del results["TRL GRPOTrainer"]
    peaks: dict[str, list] = {name: [] for name in results}
    settings = {}
    rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
    chat = load_tokenizer(str(tokenizer))
    encoded = [
        chat.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True, add_generation_prompt=True)
        for r in rows[:64]
    ]
    prompt_lengths = [len(e if isinstance(e, list) else e["input_ids"]) for e in encoded]
    for repeat in range(args.peer_repeats):
        order = list(results) if repeat % 2 == 0 else list(reversed(results))
        for name in order:
            if name.startswith("TRL"):
                settings = {
                    "per_device_train_batch_size": 16,
                    "steps_per_generation": 4,
                    "num_generations": 8,
                    "max_completion_length": args.new_tokens,
                    "temperature": 1.0,
                    "beta": 0.0,
                    "seed": 1234,
                    "use_cpu": not args.device.startswith("cuda"),
                }  # the CPU: a smoke test of this script
                command = [
                    sys.executable,
                    "-c",
                    TRL_WORKER,
                    str(directory),
                    str(tokenizer),
                    data,
                    str(args.peer_rounds),
                    json.dumps(settings),
                ]
            else:
                out = root / f"run-{repeat}-{tomls[name].stem}"
                command = [sys.executable, "-c", RLBENCH_WORKER, "run", "-c", str(tomls[name]), "--out", str(out)]
                command += ["--deterministic"] if "deterministic" in name else []
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
            if done.returncode != 0:
                sys.exit(f"{name}'s process failed ({time.perf_counter() - start:.0f} s): {done.stderr[-3000:]}")
            report = json.loads(done.stdout.strip().splitlines()[-1])
            peaks[name].append(report["peak"])
            if name.startswith("TRL"):
                results[name] += report["steps"]
                settings = report["settings"]
            else:
                rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
                results[name] += [{k: row[k] for k in row if k.startswith("perf/")} for row in rows]
                shutil.rmtree(out)  # its final checkpoint: gigabytes at these shapes
            mine = (
                report["steps"]
                if name.startswith("TRL")
                else [row["perf/step_time"] for row in results[name][-args.peer_rounds :]]
            )
            print(
                f"  {name}: process {repeat + 1} of {args.peer_repeats} done in {time.perf_counter() - start:.0f} s; "
                f"steps {', '.join(f'{t:.2f}' for t in mine)} s; peak {report['peak'] / 2**30:.1f} GiB"
                + (
                    ""
                    if name.startswith("TRL")
                    else "; " + ", ".join(f"{k[5:]} {v:.2f}" for k, v in results[name][-1].items())
                ),
                flush=True,
            )
    card = _card()
    trl = statistics.median(results["TRL GRPOTrainer"]) if "TRL GRPOTrainer" in results else None
    print(
        f"{shape}, vocab {vocab or 'fixture'}: {args.peer_repeats} alternating sets of processes, "
        f"{args.peer_rounds} steps each after one warm-up; 8 prompts x 8 samples x {args.new_tokens} new tokens, "
        f"4 optimizer steps of 16, bf16" + (f"; TRL's settings: {settings}" if trl else "")
    )
    if trl:
        print(f"  TRL GRPOTrainer          step {trl:7.2f} s  peak {max(peaks['TRL GRPOTrainer']) / 2**30:6.1f} GiB")
    for name in [n for n in results if not n.startswith("TRL")]:
        steps = [row["perf/step_time"] for row in results[name]]
        stages = {k: statistics.median(row[k] for row in results[name]) for k in results[name][0]}
        print(
            f"  {name:24s} step {statistics.median(steps):7.2f} s  peak {max(peaks[name]) / 2**30:6.1f} GiB  "
            + (f"x{statistics.median(steps) / trl:.2f} of TRL's step  " if trl else "")
            + "("
            + ", ".join(f"{k[5:]} {v:.3f}" for k, v in stages.items() if k != "perf/step_time")
            + ")"
        )
    if "rlbench --deterministic" in results and "rlbench" in results:
        det = statistics.median(row["perf/step_time"] for row in results["rlbench --deterministic"])
        free = statistics.median(row["perf/step_time"] for row in results["rlbench"])
        print(f"  deterministic / not: x{det / free:.2f}")
    if trl:
        print(
            "  peak memory against TRL's: "
            + ", ".join(
                f"{name} x{max(peaks[name]) / max(peaks['TRL GRPOTrainer']):.2f}"
                for name in results
                if not name.startswith("TRL")
            )
        )
    if card and "rlbench --deterministic" in results:
        bounds = floors(
            json.loads((directory / "config.json").read_text()),
            round(statistics.fmean(prompt_lengths)),
            args.new_tokens,
            64,
            card,
        )
        rollout = statistics.median(row["perf/rollout_time"] for row in results["rlbench --deterministic"])
        print(
            f"  the rollout's physical floor on an {card}: {bounds['rollout']:.3f} s; rlbench --deterministic's "
            f"rollout x{rollout / bounds['rollout']:.1f} of it (issue: <= 10; every stage's: below)"
        )


MEMORY = {"train": {"recompute": True, "optimizer_cpu_offload": True}, "rollout": {"offload": True}}
MEMORY_RUN = "rlbench --deterministic, memory settings"
# --peer-runs: each key's process name and its settings over the shared config. memory also spreads the host's
# optimizer update over up to 16 threads (a recorded setting: the gradient norm's sum order follows it).
PEER_RUNS = {
    "det": ("rlbench --deterministic", {}),
    "free": ("rlbench", {}),
    "memory": (MEMORY_RUN, MEMORY),
    "recompute": ("rlbench --deterministic, recompute", {"train": {"recompute": True}}),
    "recompute-offload": (
        "rlbench --deterministic, recompute, rollout offload",
        {"train": {"recompute": True}, "rollout": {"offload": True}},
    ),
}


def _card() -> str | None:
    return next((c for c in CARDS if c in torch.cuda.get_device_name()), None) if torch.cuda.is_available() else None


def _toml(config: dict) -> str:
    def value(v):
        return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)

    lines = [f"{k} = {value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for table, fields in ((k, v) for k, v in config.items() if isinstance(v, dict)):
        lines += [f"[{table}]"] + [f"{k} = {value(v)}" for k, v in fields.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.6B,1.7B")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed generations and train/bare rounds (after a warm-up)"
    )
    parser.add_argument(
        "--cost-rounds",
        type=int,
        default=9,
        help="rounds of train + sync with and without the device checksums (after a warm-up): their "
        "difference is tens of ms in a second's stage, so it needs more rounds than the rest",
    )
    parser.add_argument(
        "--no-checkpoint", action="store_true", help="skip timing a checkpoint (at 4B: ~72 GB to write)"
    )
    parser.add_argument(
        "--trainer",
        choices=("torch", "megatron"),
        default="torch",
        help="megatron: the megatron trainer (one rank, Megatron's bf16 mixed precision); its steps "
        "by stage and checkpoint only (the engine's figures are the torch runs'; the bare step "
        "is a transformers model)",
    )
    parser.add_argument(
        "--vocab",
        default=str(QWEN3_VOCAB),
        help="the model's vocab_size, with a tokenizer of Qwen3's size (151,669 ids) built offline; "
        "'fixture': the fixture model's vocabulary and tokenizer (314)",
    )
    parser.add_argument(
        "--peer",
        choices=("trl", "none"),
        default=None,
        help="also run TRL's GRPOTrainer and `rlbench run` (with and without --deterministic) in "
        "processes of their own, alternating (needs trl and a CUDA device); 'none': the two "
        "`rlbench run` processes only (deterministic mode's cost)",
    )
    parser.add_argument(
        "--peer-weights",
        choices=tuple(PEER_WEIGHTS),
        default="bf16",
        help="with --peer: the dtype the shared weights are saved in, which TRL loads them in (fp32: TRL's own "
        "mixed precision, fp32 parameters under bf16 autocast, as a user loading a float32 checkpoint runs it); "
        "rlbench casts them to its model.dtype, bfloat16, either way",
    )
    parser.add_argument("--peer-rounds", type=int, default=3, help="steps each peer process times after a warm-up")
    parser.add_argument("--peer-repeats", type=int, default=2, help="alternating sets of peer processes")
    parser.add_argument("--only-peer", action="store_true", help="the peer comparison only")
    parser.add_argument(
        "--peer-runs",
        default="det,free",
        help="with --peer: the rlbench processes, of det (--deterministic), free (without), memory "
        "(--deterministic with slime's memory settings: train.recompute, train.optimizer_cpu_offload, "
        "rollout.offload), recompute (--deterministic, train.recompute), recompute-offload (and rollout.offload)",
    )
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {gpu}; torch {torch.__version__}")
    vocab = None if args.vocab == "fixture" else int(args.vocab)
    for shape in args.shapes.split(","):
        if args.peer:
            with tempfile.TemporaryDirectory() as tmp:
                peer_trl(args, shape, Path(tmp))
        if args.only_peer:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            config = shape_config(Path(tmp), shape, args.device, args.steps + 10, args.new_tokens, args.trainer, vocab)
            ctx = build(config)
            torch_trainer = args.trainer == "torch"
            clock = Clock(args.device)
            stages, stage_peaks = step_by_stage(ctx, args.steps, clock)
            peak = max(stage_peaks.values()) if stage_peaks else float("nan")
            held = _held_memory(ctx) if stage_peaks else {}
            step = sum(v for k, v in stages.items() if k != "checksums")
            share = (stages["checksums"] + stages["record"]) / step
            gen = generation(ctx, args.new_tokens, args.repeats) if torch_trainer else None
            state = loop.StepState(args.steps + 1)
            for _, stage in STAGES[:5]:  # data .. logprob: the batch the train stage gets
                stage(ctx, state)
            with_sums, without, differences = checksum_cost(ctx, state, args.cost_rounds)
            cost = statistics.median(differences)
            quartiles = statistics.quantiles(differences, n=4) if len(differences) > 1 else differences * 3
            if torch_trainer:
                trained, bare, train_ratio = train_against_bare(ctx, state, args.repeats)
            checkpoint = "not timed (--no-checkpoint)"
            if not args.no_checkpoint:
                checkpoint = time_checkpoint(ctx, args.steps + 1, args.device)
            print(
                f"{shape} ({args.trainer} trainer): step {step:.2f} s ("
                + ", ".join(f"{k} {v:.3f}" for k, v in stages.items())
                + ")"
            )
            print(
                f"  peak memory allocated over those steps: {peak:.1f} GiB; by stage: "
                + ", ".join(f"{k} {v:.1f}" for k, v in stage_peaks.items())
                + (
                    " GiB; held between steps: " + ", ".join(f"{k} {v:.2f}" for k, v in held.items()) + " GiB"
                    if held
                    else ""
                )
            )
            if _card():
                prompts = [len(r.prompt_ids) for r in loop.step_requests(ctx, _data(ctx))]
                bounds = floors(
                    json.loads(Path(config.model.path, "config.json").read_text()),
                    round(statistics.fmean(prompts)),
                    args.new_tokens,
                    64,
                    _card(),
                )
                print(
                    f"  physical floors on an {_card()} ({bounds['params'] / 1e6:.0f} M parameters, prompts of "
                    f"{statistics.fmean(prompts):.1f} tokens): "
                    + ", ".join(
                        f"{k} {bounds[k]:.3f} s (measured x{stages[k] / bounds[k]:.1f})"
                        for k in ("rollout", "logprob", "train")
                    )
                )
            print(
                f"  checksums + recording: {share * 100:.1f}% of the step (the time inside the checksum functions, "
                f"synchronised around each call: an upper bound on their own time; issue: <= 3%)"
            )
            verdict = (
                f"the device checksums cost {cost * 1000:.1f} ms, {cost / step * 100:.1f}% of a step"
                if quartiles[0] > 0
                else "not resolved from zero by these rounds (their quartiles span it)"
            )
            print(
                f"  cross-check: train + sync over one batch, alternating {args.cost_rounds} rounds, with checksums "
                f"{with_sums:.3f} s, with their lane computations left out {without:.3f} s: the rounds' differences "
                f"median {cost * 1000:.1f} ms, quartiles {quartiles[0] * 1000:.1f} .. {quartiles[2] * 1000:.1f} ms: "
                f"{verdict} (the share above bounds the checksums' own time; this catches what they cost elsewhere)"
            )
            print(f"  a checkpoint (model + AdamW state, written every checkpoint_every steps): {checkpoint}")
            if not torch_trainer:
                ctx.writer.close()
                ctx.trainer.close()
                continue
            print(
                f"  generation: engine {gen['engine_tok_s']:.0f} tok/s, transformers generate "
                f"{gen['generate_tok_s']:.0f} tok/s: x{gen['engine_tok_s'] / gen['generate_tok_s']:.2f} "
                f"(issue: >= 5); without CUDA graphs {gen['eager_tok_s']:.0f} tok/s; graphs and eager the same "
                f"bits: {gen['graphs_same_bits']}"
            )
            print(
                f"  train stage {trained:.3f} s vs a bare torch step {bare:.3f} s over the same batch, alternating "
                f"{args.repeats} rounds: x{train_ratio:.2f} (median of the rounds' ratios; issue: <= 1.2)"
            )
            ctx.writer.close()
            del ctx
            torch.cuda.empty_cache() if args.device.startswith("cuda") else None


if __name__ == "__main__":
    main()
