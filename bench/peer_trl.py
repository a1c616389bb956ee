"""rlbench's step against a widely used GRPO trainer's (TRL's GRPOTrainer), step for step, at one shape:
the tiny-qwen3 model with the same initial weights, the qwen-tiny tokenizer and chat template, the parity
data and verifier, 8 prompts x 8 samples per step, 4 new tokens at temperature 1, 4 optimizer steps of 16
samples, no KL term, fp32 on the CPU. A "step" is one generation round and its 4 optimizer steps (TRL:
steps_per_generation=4, per_device_train_batch_size=16).

Two ways, named for what they are:

- `--mode processes` (the default; the figure to quote): each as its users run it, in a process of its own
  with its own defaults, alternating. TRL: `GRPOTrainer` on a model loaded with `from_pretrained` (the same
  weights, saved once as safetensors), torch's default threads and numerics, nothing of rlbench imported.
  rlbench: `rlbench run` at this shape with its defaults (1 thread, portable numerics, deterministic). Each
  process runs `--rounds` steps after one warm-up; TRL's round is timed by a callback around its 4 optimizer
  steps, rlbench's is its own `perf/step_time`. The processes alternate `--repeats` times, so machine noise
  falls on both; the medians over every round of every repeat, and their ratio, are printed.
- `--mode in-process`: both inside one rlbench process, TRL under rlbench's portable numerics and
  deterministic settings (a TRL callback runs one rlbench step after each TRL round): what TRL costs when
  forced into rlbench's settings, not what its users see.

TRL is not an rlbench dependency; install it beside the pinned torch:
    python -m pip install -c constraints.txt trl
Run:  python bench/peer_trl.py [--mode processes|in-process] [--rounds 12] [--repeats 3]
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
from rlbench.session import build  # noqa: E402
from rlbench.core.model import build_model, load_tokenizer  # noqa: E402
from rlbench.core.reward import RewardInput, parity  # noqa: E402

GENERATIONS, PER_DEVICE, ROUND = 8, 16, 4  # samples per prompt; optimizer-step batch; optimizer steps per round


def parity_reward(completions, label, **_) -> list[float]:
    """rlbench's verifier, in TRL's reward-function form (conversational completions)."""
    return [parity(RewardInput((), c[0]["content"], lab, "stop")) for c, lab in zip(completions, label)]


TRL_WORKER = r"""
import json, re, sys, tempfile, time, warnings
from pathlib import Path
warnings.filterwarnings("ignore")
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model_dir, tokenizer_dir, data, rounds, settings = sys.argv[1:6]
rounds, settings = int(rounds), json.loads(settings)  # GRPOConfig's settings the caller sets; TRL's defaults else
round_steps = settings["steps_per_generation"]
WORD = re.compile(r"\b(even|odd)\b", re.IGNORECASE)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def parity(completions, label, **_):  # rlbench's verifier (rlbench/core/reward.py), not imported: TRL alone here
    found = [WORD.search(c[0]["content"]) for c in completions]
    return [1.0 if f and f.group(0).lower() == lab.lower() else 0.0 for f, lab in zip(found, label)]


rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows])
times = []


class Rounds(TrainerCallback):  # a round: one generation and its optimizer steps
    def on_train_begin(self, targs, state, control, **kw):
        sync()
        self.mark = time.perf_counter()

    def on_step_end(self, targs, state, control, **kw):
        if state.global_step % round_steps == 0:
            sync()
            now = time.perf_counter()
            times.append(now - self.mark)
            self.mark = now


with tempfile.TemporaryDirectory() as tmp:
    args = GRPOConfig(output_dir=tmp, max_steps=round_steps * (rounds + 1), report_to="none", save_strategy="no",
                      disable_tqdm=True, **settings)
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # as its users load it: the dtype the checkpoint says
    GRPOTrainer(model=model, reward_funcs=parity, args=args,
                train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(tokenizer_dir),
                callbacks=[Rounds()]).train()
print(json.dumps({"steps": times[1:], "peak": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
                  "settings": {"bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing,
                               "use_vllm": args.use_vllm, "loss_type": args.loss_type,
                               "parameters": str(next(model.parameters()).dtype)}}))
"""


def _processes(args) -> None:
    """Each in a process of its own with its own defaults, alternating."""
    import os
    import subprocess

    from safetensors.torch import save_file

    from rlbench.core.model import named_weights

    config = load_config()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        model = build_model(config.model.path, config.seed, init=config.model.init)
        model.config.save_pretrained(model_dir)
        save_file({k: v.contiguous() for k, v in named_weights(model).items()}, str(model_dir / "model.safetensors"))
        shape = Path(tmp) / "shape.toml"
        shape.write_text(
            f"steps = {args.rounds + 1}\n[data]\nprompts_per_step = 8\n[rollout]\n"
            f"n_samples_per_prompt = {GENERATIONS}\nmax_new_tokens = 4\n[train]\nminibatches = {ROUND}\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "ATEN_", "RLBENCH_", "OMP_"))}
        trl, ours = [], []
        for repeat in range(args.repeats):
            settings = {
                "per_device_train_batch_size": PER_DEVICE,
                "steps_per_generation": ROUND,
                "num_generations": GENERATIONS,
                "max_completion_length": 4,
                "temperature": 1.0,
                "learning_rate": 1e-3,
                "beta": 0.0,
                "use_cpu": True,
                "bf16": False,
                "seed": config.seed,
            }
            res = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    TRL_WORKER,
                    str(model_dir),
                    config.model.tokenizer,
                    config.data.path,
                    str(args.rounds),
                    json.dumps(settings),
                ],
                capture_output=True,
                text=True,
                env=env,
            )
            if res.returncode != 0:
                sys.exit(f"TRL's process failed: {res.stderr[-2000:]}")
            trl += json.loads(res.stdout.strip().splitlines()[-1])["steps"]
            out = Path(tmp) / f"rlbench-{repeat}"
            res = subprocess.run(
                [sys.executable, "-m", "rlbench", "run", "-c", str(shape), "--out", str(out), "--json"],
                capture_output=True,
                text=True,
                env=env,
            )
            if res.returncode != 0:
                sys.exit(f"rlbench's process failed: {res.stderr[-2000:]}")
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            ours += [row["perf/step_time"] for row in rows[1:]]
    print(
        f"{args.repeats} alternating pairs of processes, {args.rounds} rounds each after one warm-up; 8 prompts x "
        f"{GENERATIONS} samples, 4 new tokens, {ROUND} minibatches of {PER_DEVICE}; each with its own defaults "
        f"(TRL: torch's {os.cpu_count()}-core default threads and numerics; rlbench: 1 thread, portable numerics)"
    )
    print(f"  TRL GRPOTrainer  median {statistics.median(trl) * 1e3:8.1f} ms a round  ({len(trl)} rounds)")
    print(f"  rlbench          median {statistics.median(ours) * 1e3:8.1f} ms a step   ({len(ours)} steps)")
    print(f"  ratio rlbench / TRL: {statistics.median(ours) / statistics.median(trl):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("processes", "in-process"), default="processes")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="--mode processes: alternating pairs of processes")
    parser.add_argument("--threads", type=int, default=1, help="--mode in-process: torch threads for both")
    args = parser.parse_args()
    if args.mode == "processes":
        _processes(args)
        return
    warnings.filterwarnings("ignore", category=FutureWarning)  # TRL's use of renamed transformers options
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        sys.exit(f"needs trl (python -m pip install -c constraints.txt trl): {exc}")

    # The shape, whatever the default run's is: 8 prompts x 8 samples, 4 new tokens, 4 minibatches of 16.
    config = load_config(
        threads=args.threads,
        steps=args.rounds + 1,
        data__prompts_per_step=8,
        rollout__n_samples_per_prompt=GENERATIONS,
        rollout__max_new_tokens=4,
        train__minibatches=ROUND,
    )
    with tempfile.TemporaryDirectory() as tmp:
        ctx = build(config.replace(out=str(Path(tmp) / "rlbench")))  # sets threads and deterministic mode
        rows = [json.loads(line) for line in Path(config.data.path).read_text().splitlines()]
        dataset = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]} for r in rows]
        )
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
            output_dir=str(Path(tmp) / "trl"),
            per_device_train_batch_size=PER_DEVICE,
            steps_per_generation=ROUND,
            num_generations=GENERATIONS,
            max_completion_length=config.rollout.max_new_tokens,
            temperature=config.rollout.temperature,
            learning_rate=config.train.lr,
            beta=0.0,
            max_steps=ROUND * args.rounds,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=config.seed,
        )
        trainer = GRPOTrainer(
            model=build_model(config.model.path, config.seed, init=config.model.init),
            reward_funcs=parity_reward,
            args=trl_config,
            train_dataset=dataset,
            processing_class=load_tokenizer(config.model.tokenizer),
            callbacks=[Alternate()],
        )
        trainer.train()
        ctx.writer.close()
    ours_steps = [sum(stage.values()) for stage in ours[1:]]
    theirs_steps = theirs[1:]
    print(
        f"{len(ours_steps)} alternating steps each after one warm-up; 8 prompts x 8 samples, "
        f"{config.rollout.max_new_tokens} new tokens, 4 minibatches of 16, {args.threads} thread(s)"
    )
    print(
        f"  TRL GRPOTrainer  median {statistics.median(theirs_steps) * 1e3:8.1f} ms  "
        f"[{', '.join(f'{t * 1e3:.0f}' for t in theirs_steps)}]"
    )
    print(
        f"  rlbench          median {statistics.median(ours_steps) * 1e3:8.1f} ms  "
        f"[{', '.join(f'{t * 1e3:.0f}' for t in ours_steps)}]"
    )
    for name in ours[0]:
        print(f"    {name:10s} {statistics.median(s[name] for s in ours[1:]) * 1e3:8.2f} ms")
    print(
        f"  ratio rlbench / TRL (in-process, TRL under rlbench's numerics and settings): "
        f"{statistics.median(ours_steps) / statistics.median(theirs_steps):.2f}"
    )


if __name__ == "__main__":
    main()
