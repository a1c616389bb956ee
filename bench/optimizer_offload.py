"""Where an offloaded optimizer update's time goes (`train.optimizer_cpu_offload`), at a real shape on one GPU.

    python bench/optimizer_offload.py [--shape 0.6B] [--threads 1,16] [--updates 3]

A torch trainer over a Qwen3-shaped model (random bf16 weights, Qwen3's vocabulary) trains one minibatch of 16
samples x (17 + 256) tokens per update, with and without the offload, each part of the update timed (the GPU
synchronised around each): forward and backward (the staging hooks' copies inside them), the flush (the staged
gradients added on the host), the gradients' checksums, the clipping, AdamW's update, the masters copied back. The
median over `--updates` updates after one warm-up, per CPU thread count (`threads`, the run setting).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from scale import QWEN3_VOCAB, model_dir  # noqa: E402  (the shapes and their config.json)

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

from rlbench.backends.torch_trainer import TorchTrainer  # noqa: E402
from rlbench.config import load_config  # noqa: E402
from rlbench.core import algo  # noqa: E402
from rlbench.core.model import build_model  # noqa: E402
from rlbench.rundir import digest  # noqa: E402

PARTS = ("flush", "named_grads", "clip_grads", "optimizer_step")
ADD_ALL = digest.Digests.add_all


def _timed(times: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if name == "named_grads":
            out = list(out)  # a generator: its work is the list's
        torch.cuda.synchronize()
        times[name] = times.get(name, 0.0) + time.perf_counter() - start
        return out

    return wrapper


def measure(directory: Path, offload: bool, threads: int, updates: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = load_config()
    model = build_model(str(directory), 1234, dtype="bfloat16", init="random")
    train = load_config(
        train__minibatches=1, train__micro_batch_size=16, train__optimizer_cpu_offload=offload, train__recompute=offload
    ).train
    trainer = TorchTrainer(model, train, config.algo, 1.0, seed=0, device="cuda")
    times: dict[str, float] = {}
    for name in PARTS:
        if name == "flush":
            if trainer.masters is not None:
                trainer.masters.flush = _timed(times, name, trainer.masters.flush)
            continue
        setattr(trainer, name, _timed(times, name, getattr(trainer, name)))
    if trainer.masters is not None:
        trainer.masters.copy_to_model = _timed(times, "copy_to_model", trainer.masters.copy_to_model)
    digest.Digests.add_all = _timed(times, "checksums", ADD_ALL)  # the gradients' checksums
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 151_000, (16, 273), generator=gen)
    mask = torch.zeros(16, 273)
    mask[:, 17:] = 1
    batch = algo.TrainBatch(tokens, mask, torch.randn(16, generator=gen), torch.zeros(16, 273), None)
    batch.old_logprobs = trainer.logprobs(tokens) * mask
    rows = []
    for update in range(updates + 1):
        times.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(batch, update)
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        rows.append({"update": total, **times, "rest (forward, backward, ...)": total - sum(times.values())})
    return {k: statistics.median(r[k] for r in rows[1:]) for k in rows[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6B")
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--updates", type=int, default=3)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir(Path(tmp), args.shape, QWEN3_VOCAB)
        for offload, threads in [(False, 1)] + [(True, int(t)) for t in args.threads.split(",")]:
            parts = measure(directory, offload, threads, args.updates)
            label = f"offload, {threads} threads" if offload else "on the GPU"
            print(f"  {label:22s} " + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()), flush=True)


if __name__ == "__main__":
    main()
