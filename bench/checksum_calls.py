"""What each checksum call of a step costs at a real model size, one call at a time.

    python bench/checksum_calls.py [--shape 1.7B] [--device cuda] [--reps 5] [--rounds 6]

Builds bench/scale.py's Qwen3 shape (random weights, the fixture tokenizer, bf16 over fp32 masters, 8 prompts x
8 samples x 256 new tokens, 4 minibatches, deterministic), runs one step and the next step's stages up to the
train stage, then times, each call alone between two device synchronisations (median of `--reps` after a
warm-up):
- the trainer's gradient checksums of one minibatch (`Digests.add_all` over the fp32 master gradients, then
  `hexdigests`), beside a device copy of the same bytes (a memory-bound reference);
- the exported weights' checksums (`weights_digests`) and the engine's (`tensor_digests`), what the train and
  sync stages checksum once a step;
and their sum per step (one gradient set per minibatch), against the train and sync stages over one batch run with
and without the checksums' lane computations (bench/scale.py's `checksum_cost`), alternating `--rounds` rounds.
The per-call figures are the checksums' own time with nothing to overlap them; the rounds show what a step sees.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(BENCH)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]
from stages import STAGES, sync_device  # noqa: E402
import scale  # noqa: E402  (it puts this folder first on the path and takes it off again)

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]  # see scale.py: megatron's namespace

import torch  # noqa: E402

from rlbench.core import loop  # noqa: E402
from rlbench.session import build  # noqa: E402
from rlbench.core.model import named_weights  # noqa: E402
from rlbench.rundir import digest  # noqa: E402


def timed(device: str, fn, reps: int) -> float:
    """Median seconds of `fn()` between two synchronisations, `reps` calls after a warm-up one."""
    fn()
    times = []
    for _ in range(reps):
        sync_device(device)
        start = time.perf_counter()
        fn()
        sync_device(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.7B", choices=sorted(scale.SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=5, help="timed calls of each checksum (after a warm-up)")
    parser.add_argument("--rounds", type=int, default=6, help="train + sync rounds with and without checksums")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {gpu}; torch {torch.__version__}; shape {args.shape}")
    with tempfile.TemporaryDirectory() as tmp:
        config = scale.shape_config(Path(tmp), args.shape, args.device, steps=20)
        ctx = build(config)
        state = loop.StepState(0)
        for _, stage in STAGES:
            stage(ctx, state)
        state = loop.StepState(1)
        for _, stage in STAGES[:5]:  # data .. logprob: the batch the train stage gets
            stage(ctx, state)

        grads = list(ctx.trainer.named_grads())  # the last minibatch's: the same tensors every minibatch fills
        grad_bytes = sum(g.numel() * g.element_size() for _, g in grads)

        def grad_checksums():
            sums = digest.Digests([None])
            sums.add_all((name, grad, (None, name)) for name, grad in grads)
            return sums.hexdigests()

        flat = torch.empty(grad_bytes, dtype=torch.uint8, device=args.device)
        views = [g.reshape(-1).view(torch.uint8) for _, g in grads]
        weights = ctx.trainer.export_hf_weights()
        engine = named_weights(ctx.engine.model)
        weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        engine_bytes = sum(t.numel() * t.element_size() for t in engine.values())
        figures = {
            f"gradients of one minibatch ({len(grads)} {grads[0][1].dtype} tensors)": (
                timed(args.device, grad_checksums, args.reps),
                grad_bytes,
            ),
            "  a device copy of the same bytes (reference)": (
                timed(args.device, lambda: torch.cat(views, out=flat), args.reps),
                grad_bytes,
            ),
            f"the exported weights ({len(weights)} tensors)": (
                timed(args.device, lambda: digest.weights_digests(weights), args.reps),
                weight_bytes,
            ),
            f"the engine's weights ({len(engine)} tensors)": (
                timed(args.device, lambda: digest.tensor_digests(engine), args.reps),
                engine_bytes,
            ),
        }
        for label, (seconds, nbytes) in figures.items():
            print(f"{label}: {seconds * 1000:.2f} ms, {nbytes / 1e6:.1f} MB, {nbytes / seconds / 1e9:.1f} GB/s")
        (grad_s, _), _, (weights_s, _), (engine_s, _) = figures.values()
        per_step = config.train.minibatches * grad_s + weights_s + engine_s
        print(
            f"per step ({config.train.minibatches} minibatches' gradients, the weights, the engine's): "
            f"{per_step * 1000:.1f} ms"
        )

        with_sums, without, differences = scale.checksum_cost(ctx, state, args.rounds)
        print(
            f"train + sync over one batch, alternating {args.rounds} rounds after a warm-up: with checksums "
            f"{with_sums:.3f} s, without {without:.3f} s; "
            f"the rounds' differences median {statistics.median(differences) * 1000:.1f} ms, from "
            f"{differences[0] * 1000:.1f} to {differences[-1] * 1000:.1f} ms"
        )
        ctx.writer.close()


if __name__ == "__main__":
    main()
