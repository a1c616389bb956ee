"""rlbench's embedded step against a widely used GRPO trainer's (TRL's GRPOTrainer), step for step.

Both run the same job: the tiny-qwen3 model with the same initial weights (rlbench's seeded
init), the qwen-tiny tokenizer and chat template, the parity data and verifier, 8 prompts x 8
samples per step, 4 new tokens at temperature 1, 4 optimizer steps of 16 samples, no KL term,
fp32 on the CPU, one torch thread, deterministic algorithms on. A "step" is one generation
round and its 4 optimizer steps (TRL: steps_per_generation=4, per_device_train_batch_size=16).

They alternate inside one process: a TRL callback runs one rlbench step (timed by stage)
after each TRL round, so machine noise falls on both. The first round of each is a warm-up.
Prints both medians and the ratio rlbench / TRL (the issue's bar: <= 0.5).

TRL is not an rlbench dependency; install it beside the pinned torch:
    python -m pip install -c constraints.txt trl
Run:  python bench/peer_trl.py [--rounds 12] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import warnings
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stages import timed_step  # noqa: E402

from rlbench.config import load_config  # noqa: E402
from rlbench.core.context import build  # noqa: E402
from rlbench.core.model import build_model, load_tokenizer  # noqa: E402
from rlbench.core.reward import RewardInput, parity  # noqa: E402

GENERATIONS, PER_DEVICE, ROUND = 8, 16, 4  # samples per prompt; optimizer-step batch; optimizer steps per round


def parity_reward(completions, label, **_) -> list[float]:
    """rlbench's verifier, in TRL's reward-function form (conversational completions)."""
    return [parity(RewardInput((), c[0]["content"], lab, "stop")) for c, lab in zip(completions, label)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # TRL's use of renamed transformers options
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        sys.exit(f"needs trl (python -m pip install -c constraints.txt trl): {exc}")

    # The shape, whatever the default run's is: 8 prompts x 8 samples, 4 new tokens, 4 minibatches of 16.
    config = load_config(threads=args.threads, steps=args.rounds + 1, data__prompts_per_step=8,
                         rollout__n_samples_per_prompt=GENERATIONS, rollout__max_new_tokens=4, train__minibatches=ROUND)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = build(config.replace(out=str(Path(tmp) / "rlbench")))  # sets threads and deterministic mode
        rows = [json.loads(line) for line in Path(config.data.path).read_text().splitlines()]
        dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                                     for r in rows])
        ours, theirs = [], []

        class Alternate(TrainerCallback):
            """After each TRL round: note its time, then run and time one rlbench step."""

            def __init__(self):
                self.mark = None

            def on_step_end(self, targs, state, control, **kw):
                if state.global_step % ROUND:
                    return
                now = time.perf_counter()
                if self.mark is not None:
                    theirs.append(now - self.mark)
                ours.append(timed_step(ctx, len(ours)))
                self.mark = time.perf_counter()

            def on_train_begin(self, targs, state, control, **kw):
                self.mark = time.perf_counter()

        trl_config = GRPOConfig(
            output_dir=str(Path(tmp) / "trl"), per_device_train_batch_size=PER_DEVICE, steps_per_generation=ROUND,
            num_generations=GENERATIONS, max_completion_length=config.rollout.max_new_tokens,
            temperature=config.rollout.temperature, learning_rate=config.train.lr, beta=0.0,
            max_steps=ROUND * args.rounds, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
            disable_tqdm=True, seed=config.seed)
        trainer = GRPOTrainer(model=build_model(config.model.path, config.seed, init=config.model.init), reward_funcs=parity_reward,
                              args=trl_config, train_dataset=dataset,
                              processing_class=load_tokenizer(config.model.tokenizer), callbacks=[Alternate()])
        trainer.train()
        ctx.writer.close()
    ours_steps = [sum(stage.values()) for stage in ours[1:]]
    theirs_steps = theirs[1:]
    print(f"{len(ours_steps)} alternating steps each after one warm-up; 8 prompts x 8 samples, "
          f"{config.rollout.max_new_tokens} new tokens, 4 minibatches of 16, {args.threads} thread(s)")
    print(f"  TRL GRPOTrainer  median {statistics.median(theirs_steps) * 1e3:8.1f} ms  "
          f"[{', '.join(f'{t * 1e3:.0f}' for t in theirs_steps)}]")
    print(f"  rlbench          median {statistics.median(ours_steps) * 1e3:8.1f} ms  "
          f"[{', '.join(f'{t * 1e3:.0f}' for t in ours_steps)}]")
    for name in ours[0]:
        print(f"    {name:10s} {statistics.median(s[name] for s in ours[1:]) * 1e3:8.2f} ms")
    print(f"  ratio rlbench / TRL: {statistics.median(ours_steps) / statistics.median(theirs_steps):.2f}")


if __name__ == "__main__":
    main()
