"""Issue 55's figures: `check logprobs --attribute` on runs with one planted cause each, over seeds, and what the
attribution costs against the run's own log-prob stage.

For each cause and seed: a 2-step run with a checkpoint every step (the weights every step sampled and trained
with), then the attribution (checks/attribution_run.attribute_run, on the run's device). Printed per run: the link the
cause belongs to, its share of the measured mismatch (pass: >= 80%), the largest link, the mismatch itself, and the
cost: the attribution's seconds over the seconds of the log-prob stage's own pass over the same steps (the trainer's
`logprobs` with the step's weights, as core/loop.py's logprob stage calls it), both timed in this process, the
device synchronised, after one untimed warm-up (the process's first attribution, the stage's first round); and the
attribution's forwards alone over the same, the weights' reading and verifying apart (what it reads from disk is the
checkpoints', what the log-prob stage holds in memory already).

    python bench/attribution.py [--shape fixture|0.6B] [--device cpu|cuda] [--seeds 1,2,3] [--causes all]
                                [--new-tokens N] [--keep DIR]

The causes (bench's names): default (the unchanged run: no cause; its float32 rounding shows in `cache`),
nondeterministic (default with deterministic = false, GPU), engine-bf16 (rollout.dtype bfloat16 against a float32
trainer), engine-fp8 (rollout.quantization fp8), stale-version (--async one-step), engine-top-p (rollout.logprobs
filtered, top_p 0.9), batch-variant (rollout.batch_invariant false), prefix-reuse
(rollout.prefix_invariant false). `--shape 0.6B`: Qwen3-0.6B's shape with its
vocabulary (151,936 logits; bench/scale.py), random weights. With `--keep DIR` a run already there is attributed
again, not made again (a GPU host's 10-minute calls carry it on).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from scale import QWEN3_VOCAB, model_dir, real_tokenizer  # noqa: E402
from stages import sync_device as sync  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

from rlbench.config import apply_overrides, load_config  # noqa: E402

CAUSES = {  # name: (the link it belongs to, its overrides)
    "default": ("cache", {}),
    "nondeterministic": ("cache", {"deterministic": False}),
    "engine-bf16": ("dtype", {"model__dtype": "float32", "rollout__dtype": "bfloat16"}),
    "engine-fp8": ("dtype", {"rollout__quantization": "fp8"}),
    "stale-version": ("weights", {"rollout__async_mode": "one-step"}),  # + an entropy bonus at 0.6B: `main`
    "engine-top-p": ("definition", {"rollout__logprobs": "filtered", "rollout__top_p": 0.9}),
    "batch-variant": ("cache", {"rollout__batch_invariant": False}),
    "prefix-reuse": ("cache", {"rollout__prefix_invariant": False}),
}


def base_config(shape: str, device: str, root: Path, new_tokens: int):
    if shape == "fixture":  # the small config of tests/conftest.py, for the CPU
        return load_config(
            steps=2,
            checkpoint_every=1,
            device=device,
            data__prompts_per_step=2,
            rollout__n_samples_per_prompt=4,
            train__minibatches=2,
            train__micro_batch_size=3,
        )
    tokenizer = root / "tokenizer"
    if not tokenizer.is_dir():
        real_tokenizer(root)
    model = root / shape
    if not model.is_dir():
        model_dir(root, shape, QWEN3_VOCAB)
    return load_config(
        model__path=str(model),
        model__init="random",
        model__dtype="bfloat16",
        model__tokenizer=str(tokenizer),
        device=device,
        deterministic=True,
        steps=2,
        checkpoint_every=1,
        data__prompts_per_step=8,
        rollout__n_samples_per_prompt=8,
        rollout__max_new_tokens=new_tokens,
        train__minibatches=4,
        train__micro_batch_size=16,
    )


def logprob_stage_seconds(out: Path, device: str) -> float:
    """The log-prob stage's own pass over the run's steps (each step's checkpoint in the trainer), timed."""
    from rlbench.backends.torch_trainer import TorchTrainer
    from rlbench.checks.logprobs import verified_model
    from rlbench.core.model import load_named_, load_safetensors
    from rlbench.core.samples import train_batch
    from rlbench.replay.integrity import open_run
    from rlbench.replay.replay import source_config
    from rlbench.rundir import recording
    from rlbench.rundir.directory import step_name

    run = open_run(out, recordings="verify", checkpoints="present", need_steps=True, need_recordings=True).run
    config = source_config(run)
    trainer = TorchTrainer(
        verified_model(run, config), config.train, config.algo, config.rollout.temperature, 0, device
    )
    total = 0.0
    for _ in range(2):  # the first a warm-up
        total = 0.0
        for step in run.steps:
            tensors, _ = recording.read_step(run.root, step)
            load_named_(
                trainer.model, load_safetensors(run.root / "checkpoints" / step_name(step) / "model.safetensors")
            )
            batch = train_batch({**tensors, "advantages": torch.zeros(tensors["rewards"].shape)})
            sync(device)
            start = time.perf_counter()
            with torch.no_grad():
                trainer.logprobs(batch.tokens, lengths=batch.lengths, per_sample=config.rollout.true_on_policy)
            sync(device)
            total += time.perf_counter() - start
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="fixture", choices=("fixture", "0.6B"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--causes", default="all")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--keep", type=Path, default=None)
    parser.add_argument(
        "--drop-runs",
        action="store_true",
        help="remove each run once attributed (a GPU host's disk: 7 GB a checkpoint)",
    )
    args = parser.parse_args()
    import tempfile

    from rlbench.checks.attribution_run import attribute_run
    from rlbench.session import run

    root = args.keep or Path(tempfile.mkdtemp(prefix="rlbench-attribution-"))
    root.mkdir(parents=True, exist_ok=True)
    base = base_config(args.shape, args.device, root, args.new_tokens)
    causes = list(CAUSES) if args.causes == "all" else args.causes.split(",")
    rows, passed, judged = [], 0, 0
    print(f"shape {args.shape}, device {args.device}, torch {torch.__version__}", flush=True)
    for cause in causes:
        link, overrides = CAUSES[cause]
        for seed in (int(s) for s in args.seeds.split(",")):
            out = root / f"{cause}-seed{seed}"
            if not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
                if out.exists():
                    import shutil

                    shutil.rmtree(out)
                if cause == "stale-version" and args.shape != "fixture":
                    # random weights score 0 on every sample: GRPO's advantages are 0 and the weights would not move
                    # between versions; an entropy bonus moves them
                    overrides = {**overrides, "algo__entropy_coef": 0.01}
                run(apply_overrides(base, seed=seed, out=str(out), **overrides))
            if not rows:
                attribute_run(out, device=args.device)  # a warm-up (the process's first forwards), untimed
            sync(args.device)
            start = time.perf_counter()
            found, context = attribute_run(out, device=args.device)
            sync(args.device)
            seconds = time.perf_counter() - start
            parts = context["seconds"]
            stage = logprob_stage_seconds(out, args.device)
            share = next((entry.share for entry in found.links if entry.names == (link,)), 0.0)
            ok = share >= 0.8 if cause not in ("default", "nondeterministic") else None
            judged += ok is not None
            passed += bool(ok)
            row = {
                "cause": cause,
                "seed": seed,
                "link": link,
                "share": round(share, 4),
                "largest": found.largest,
                "mismatch": found.total.mean_abs,
                "links": {entry.name: entry.mean_abs for entry in found.links},
                "attribution_s": round(seconds, 3),
                "logprob_stage_s": round(stage, 3),
                "ratio": round(seconds / stage, 2),
                "setup_s": round(seconds - parts["steps"], 3),  # opening the run, its models, the summing up
                "weights_s": round(parts["weights"], 3),  # waiting for each version's weights to be read, verified
                "forwards_s": round(parts["forwards"], 3),
                "forwards_ratio": round(parts["forwards"] / stage, 2),
                "alone_s": round(parts["alone"], 3),  # of the forwards, one sample each
                "alone_forwards": context["alone_forwards"],
                "pass": ok,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.drop_runs:
                import shutil

                shutil.rmtree(out)
    print(f"planted causes in their own link with >= 80% of the mismatch: {passed} of {judged}")
    for key, what in (("ratio", "the whole attribution"), ("forwards_ratio", "its forwards alone")):
        ratios = [row[key] for row in rows]
        print(f"{what} over the log-prob stage: min {min(ratios)}x, max {max(ratios)}x over {len(rows)} runs")


if __name__ == "__main__":
    main()
