"""What chunking the LM head with the log-softmax (rlbench/core/lm_head.py, issue 57) changes at a real vocabulary: the
log-prob and train stages' time and peak memory, chunked against the whole-logits pass the trainer ran before (the
model's logits made whole, then algo's chunked float32 log-softmax: lm_head.from_logits), in one process, alternating.

    python bench/lm_head.py [--shape 0.6B] [--device cuda] [--rounds 3] [--new-tokens 256]

One step's batch (8 prompts x 8 samples, `--new-tokens` new tokens, bf16 over fp32 masters, deterministic) is made
once; then each round runs the logprob stage and the train stage (4 minibatches of 16, micro-batches of 16) under each
pass, the order flipping every round, the device synchronised around each stage, its peak allocated memory measured
from what was allocated as it began. Before any training, both passes' log-probs of the same weights are compared
(the largest |difference| over the batch's tokens: the chunked head's rounding on this device). Each train stage
updates the weights, so later rounds train other weights: the same shapes and work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from scale import QWEN3_VOCAB, shape_config  # noqa: E402
from stages import STAGES, sync_device  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

import torch  # noqa: E402

from rlbench.core import lm_head, loop  # noqa: E402
from rlbench.session import build  # noqa: E402


def _whole(trainer):
    """The pass before issue 57, bound to `trainer`: the model's logits whole, then the float32 work in chunks."""

    def token_terms(model, ids, keep=None, entropy=None):
        return lm_head.from_logits(trainer.model_logits(model, ids, keep), ids, trainer.temperature, entropy)

    return token_terms


def _stage(ctx, state, stage, device: str) -> tuple[float, float]:
    """(seconds, peak GiB allocated above what was allocated when it began) of one stage."""
    sync_device(device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    stage(ctx, state)
    sync_device(device)
    took = time.perf_counter() - start
    return took, (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6B")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--profile", action="store_true", help="then one logprob and one train stage of each pass under torch.profiler"
    )
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device: {gpu}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        config = shape_config(Path(tmp), args.shape, args.device, 10, args.new_tokens, "torch", QWEN3_VOCAB)
        ctx = build(config)
        trainer = ctx.trainer
        passes = {"chunked": trainer.token_terms, "whole": _whole(trainer)}
        state = loop.StepState(0)
        for _, stage in STAGES[:4]:  # data, rollout, reward, advantage
            stage(ctx, state)
        logprobs = {}
        for name, terms in passes.items():
            trainer.token_terms = terms
            loop.logprob(ctx, state)
            logprobs[name] = state.batch.old_logprobs.clone()
        gap = (logprobs["chunked"] - logprobs["whole"]).abs().max().item()
        tokens = int(state.batch.loss_mask.sum())
        times = {(name, stage): [] for name in passes for stage in ("logprob", "train")}
        peaks = {key: [] for key in times}
        for r in range(args.rounds + 1):
            for name in passes if r % 2 == 0 else reversed(list(passes)):
                trainer.token_terms = passes[name]
                for stage_name, stage in (("logprob", loop.logprob), ("train", loop.train)):
                    took, peak = _stage(ctx, state, stage, args.device)
                    if r:  # round 0 warms both up
                        times[name, stage_name].append(took)
                        peaks[name, stage_name].append(peak)
        print(
            f"{args.shape}, vocab {QWEN3_VOCAB}: 64 samples ({tokens} trained tokens), micro-batches of 16, "
            f"{args.rounds} alternating rounds after a warm-up"
        )
        print(f"  log-probs of the same weights, chunked against whole: max |difference| {gap:.3g}")
        for stage_name in ("logprob", "train"):
            row = {name: statistics.median(times[name, stage_name]) for name in passes}
            print(
                f"  {stage_name:8s} whole {row['whole']:.3f} s, peak +{max(peaks['whole', stage_name]):.2f} GiB; "
                f"chunked {row['chunked']:.3f} s, peak +{max(peaks['chunked', stage_name]):.2f} GiB; "
                f"time x{row['chunked'] / row['whole']:.2f}"
            )
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for name in passes:
                trainer.token_terms = passes[name]
                for stage_name, stage in (("logprob", loop.logprob), ("train", loop.train)):
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        stage(ctx, state)
                        sync_device(args.device)
                    print(f"--- {name} {stage_name}")
                    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14)
                    print(table)


if __name__ == "__main__":
    main()
