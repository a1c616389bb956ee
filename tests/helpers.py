"""Helpers the test files share, in one module (no test file imports another's private names).

- The engine's batch-invariance property (tests/cpu/test_batch_invariance.py, tests/gpu/test_engine_cuda.py):
  a naive batched engine that breaks it, request specs as hypothesis strategies, and the check itself.
- Trainer batches (test_checkpoint, test_mixed_precision, test_weight_decay): a seeded batch, its old log-probs,
  a checkpoint's files written out.
- TableLogits: a 'model' with fixed logits, by position or by sample (the trainer's loss by hand; slime's cases).
- random_tensor: seeded random bytes viewed as a dtype (the checksum tests, CPU and CUDA).
- wait_running: waiting on an SGLang-API server's /v1/loads (the conformance tests act on that event, not a clock).
- cuda_bf16: a small deterministic bf16 run on the GPU (tests/gpu).
- fixture_requests: sampled requests over the fixture's prompts (rlbench serve's weight loads, CPU and CUDA).
- wait_stopped: until a process has stopped itself at its failpoint (waitid: an event, not a clock).
- history_run_dir, history_file: run directories written by hand and a history file of them (the history tier of
  golden files: test_golden_history*.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
from hypothesis import strategies as st

from rlbench.backends.hf_engine import HFEngine
from rlbench.core import algo
from rlbench.core.types import GenerateRequest

# ---------------------------------------------------------------- the engine's batch invariance

ROWS = 4  # a small fixed batch: most examples span several chunks and sit in several rows


class NaiveEngine(HFEngine):
    """Batched decoding with variable shapes: one chunk of exactly the requests given, prompts
    padded to the longest of them. The row arithmetic then depends on the batch's size and on
    its longest prompt, which is what the fixed buckets of HFEngine rule out."""

    def _generate_batched(self, requests):
        self.batch_size = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        return self._decode_rows(list(requests), width, requests[0].max_new_tokens)


specs = st.tuples(
    st.integers(0, 12),
    st.integers(0, 2**63 - 1),
    st.sampled_from([0.0, 0.7, 1.0]),
    st.sampled_from([-1, 0, 1, 5]),
    st.sampled_from([1.0, 0.9, 0.3]),
    st.sampled_from([2, 4]),
)

batches = dict(
    batch=st.lists(specs, min_size=1, max_size=6),
    others=st.lists(specs, max_size=4),
    same_prompt=st.integers(0, 3),
    order=st.integers(0, 2**32),
)


def engine_request(prompts, eos, spec) -> GenerateRequest:
    prompt, seed, temperature, top_k, top_p, new = spec
    return GenerateRequest(prompts[prompt], seed, new, temperature, (eos,), top_k, top_p)


def moved(engine, batch, others, seed) -> list[int]:
    """Indices of `batch` whose result differs once the batch is shuffled among `others`, or
    decoded alone (the first request)."""
    before = engine.generate(batch)
    mixed = list(range(len(batch) + len(others)))
    random.Random(seed).shuffle(mixed)
    pool = batch + others
    after = dict(zip(mixed, engine.generate([pool[i] for i in mixed])))
    found = [i for i, res in enumerate(before) if after[i] != res]  # ids, log-probs (exact floats), finish
    if engine.generate(batch[:1])[0] != before[0]:
        found.append(0)
    return found


def check_property(setup, decode, batch, others, same_prompt, order):
    engines, prompts, eos, _ = setup
    batch = [engine_request(prompts, eos, s) for s in batch]
    # Neighbours that share a prompt with the batch exercise the shared-prefill path.
    others = [engine_request(prompts, eos, s) for s in others] + [
        GenerateRequest(batch[0].prompt_ids, seed, batch[0].max_new_tokens, 1.0, (eos,)) for seed in range(same_prompt)
    ]
    assert moved(engines[decode], batch, others, order) == []


# ---------------------------------------------------------------- trainer batches and checkpoints


def train_batch(step: int) -> algo.TrainBatch:
    """16 samples of 12 tokens (ids 3..299, the last 4 trained), seeded by `step`."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(3, 300, (16, 12), generator=gen)
    mask = torch.zeros(16, 12)
    mask[:, 8:] = 1
    return algo.TrainBatch(tokens, mask, torch.randn(16, generator=gen), torch.zeros(16, 12), None)


def with_old_logprobs(trainer, batch: algo.TrainBatch) -> algo.TrainBatch:
    batch.old_logprobs = trainer.logprobs(batch.tokens) * batch.loss_mask
    return batch


def write_files(files: dict[str, bytes], directory: Path) -> None:
    directory.mkdir()
    for name, data in files.items():
        (directory / name).write_bytes(data)


# ---------------------------------------------------------------- a model with fixed logits


class TableLogits(torch.nn.Module):
    """A 'model' with fixed logits, read as the trainer reads a transformers model's (the logits of the last
    `logits_to_keep` positions, 0: all): a [L, V] table gives every sample the same logits by position, so every
    term of a loss can be computed by hand; an [S, L, V] table gives sample s, told apart by its first token id,
    its own rows."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone())

    def forward(self, input_ids, logits_to_keep: int = 0, use_cache: bool | None = None):
        n, length = input_ids.shape
        keep = logits_to_keep or length
        if self.table.dim() == 2:
            return SimpleNamespace(logits=self.table[length - keep : length].expand(n, -1, -1))
        return SimpleNamespace(logits=self.table[input_ids[:, 0], :length][:, length - keep :])

    # The decoder and LM head a trainer runs apart (rlbench/core/lm_head.py): the table's rows as the hidden states,
    # and a head that passes them through (the same values, the same gradients).
    def get_decoder(self):
        return lambda input_ids, use_cache=None: SimpleNamespace(last_hidden_state=self(input_ids).logits)

    def get_output_embeddings(self):
        return _PassThrough(self.table.shape[-1])


class _PassThrough(torch.nn.Module):
    """An LM head that is the identity over `vocab` wide hidden states (its weight's rows: the vocabulary)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.weight = torch.empty(vocab, 0)

    def forward(self, hidden):
        return hidden


# ---------------------------------------------------------------- tensors of random bytes


def random_tensor(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """n elements of `dtype` made of seeded random bytes (every bit pattern, NaNs and infinities included)."""
    raw = torch.randint(
        0,
        256,
        (n * torch.empty((), dtype=dtype).element_size(),),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    return (raw != 0) if dtype == torch.bool else raw.view(dtype)


# ---------------------------------------------------------------- a server's load


def wait_running(server, at_least: int = 1, in_flight: int = 0, timeout: float = 30.0) -> None:
    """Wait until the server runs `at_least` requests and holds `in_flight` in all, running or waiting
    (/v1/loads): the event the test acts on, whatever the machine's speed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = server.get("/v1/loads").json()["loads"]
        running = sum(load["num_running_reqs"] for load in loads)
        if running >= at_least and running + sum(load["num_waiting_reqs"] for load in loads) >= in_flight:
            return
        time.sleep(0.01)
    raise AssertionError(f"fewer than {at_least} requests ever ran, or fewer than {in_flight} arrived")


# ---------------------------------------------------------------- the GPU's runs


def cuda_bf16(out, steps: int = 4, checkpoint_every: int = 2, **overrides):
    """A small deterministic bf16 run on the GPU, written to `out` (tests/gpu)."""
    from rlbench.config import load_config

    return load_config(
        steps=steps,
        seed=3,
        device="cuda",
        deterministic=True,
        out=str(out),
        model__dtype="bfloat16",
        checkpoint_every=checkpoint_every,
        data__prompts_per_step=4,
        rollout__n_samples_per_prompt=4,
        train__minibatches=2,
        train__micro_batch_size=8,
        **overrides,
    )


def fixture_requests(n: int = 6, new: int = 6) -> list[GenerateRequest]:
    """`n` sampled requests (temperature 1, seeds 40..) over the fixture dataset's first prompts."""
    from rlbench.config import load_config
    from rlbench.core.data import encode_prompts, load_dataset
    from rlbench.core.model import load_tokenizer

    config = load_config()
    tokenizer = load_tokenizer(config.model.tokenizer)
    prompts = list(encode_prompts(tokenizer, load_dataset(config.data.path)[:n]).values())
    return [engine_request(prompts, tokenizer.eos_token_id, (i, 40 + i, 1.0, -1, 1.0, new)) for i in range(n)]


# ---------------------------------------------------------------- the history tier's runs and files


def history_run_dir(root: Path, series: dict[str, dict[int, float]], seed: int = 1, **manifest) -> Path:
    """A rollout-only run directory made without recording, committing steps 0..2 with these metrics (a metric
    absent at a step: not logged there); `manifest` adds or replaces manifest fields."""
    root.mkdir(parents=True)
    doc = {
        "schema": "rlbench.run/1",
        "checksum": "wordsum/1",
        "config": {"record": False, "seed": seed},
        "stages": [],
        "mode": "rollout-only",
        "device": "cpu",
        "platform": {"machine": "x86_64"},
        "versions": {"torch": "2.13.0"},
        **manifest,
    }
    (root / "manifest.json").write_text(json.dumps(doc))
    steps = sorted({s for by_step in series.values() for s in by_step} | {0, 1, 2})
    rows = [{"step": s, **{m: v[s] for m, v in series.items() if s in v}} for s in steps]
    (root / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "checksums.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in steps))
    return root


def history_file(directory: Path, runs: list[dict], keep: int | None = None) -> Path:
    """directory/history.json holding these runs' series, appended in order (reasons 'trusted 0', ...) from run
    directories directory/trusted0, ..."""
    from rlbench.checks.golden_history import append_history

    path = directory / "history.json"
    for i, series in enumerate(runs):
        append_history(history_run_dir(directory / f"trusted{i}", series), path, f"trusted {i}", keep)
    return path


def wait_stopped(proc) -> None:
    """Until the process has stopped itself at its failpoint: the kernel reports the stop to its parent
    (waitid, an event; no polling against a clock), left reportable (WNOWAIT) for Popen to reap the exit
    later. An exit instead of the stop fails the test."""

    info = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
    assert info.si_code == os.CLD_STOPPED, proc.stderr.read()


SERVE_LISTENING = "rlbench serve: listening on "


def start_serve(*flags: str) -> tuple[subprocess.Popen, threading.Event, list[str]]:
    """`rlbench serve --port 0 FLAGS` as a process of its own, as a user starts it; the event is set once it prints
    where it listens (or exits), every line it prints kept (a thread reads them all: a full pipe never stalls it)."""
    from tests.conftest import rlbench_process

    proc = rlbench_process("serve", "--port", "0", *flags, env={"HF_HUB_OFFLINE": "1"}, stderr=subprocess.STDOUT)
    ready, lines = threading.Event(), []

    def drain():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(SERVE_LISTENING):
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    return proc, ready, lines


def serve_url(started: tuple[subprocess.Popen, threading.Event, list[str]], timeout: float = 120.0) -> str:
    """The URL a `start_serve` process listens on, once it says (a failure with what it printed if it exits)."""
    proc, ready, lines = started
    ready.wait(timeout)
    listening = [line for line in lines if line.startswith(SERVE_LISTENING)]
    assert listening, f"rlbench serve did not listen (exit {proc.poll()}):\n{''.join(lines)[-3000:]}"
    return listening[0][len(SERVE_LISTENING) :].split()[0]


def stop_serve(proc: subprocess.Popen) -> None:
    """Stop a `start_serve` process by its PID with Ctrl-C's signal (killed if it outlives 30 s)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def serve_process(*flags: str):
    """`start_serve` as a context: yields the URL, stops the process at the end."""
    started = start_serve(*flags)
    try:
        yield serve_url(started)
    finally:
        stop_serve(started[0])
