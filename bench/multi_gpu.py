"""The megatron trainer at Qwen3 shapes on several GPUs of one host (issue 39): TP x DP layouts run twice and
compared bit for bit, each against TP=1 within a tolerance, and each run's step by stage.

    python bench/multi_gpu.py [--shape 1.7B] [--layouts tp2dp2,tp2,dp2] [--dtypes bfloat16,float32] [--steps 3]
                              [--vocab 151936|fixture] [--device cuda] [--out DIR] [--rtol bfloat16=1e-2,...]
                              [--drop-checkpoints]

For each dtype: TP=1 once (the reference), then each layout twice (`rlbench run --trainer megatron --tp T --dp D
--deterministic`, random weights of bench/scale.py's shape, Qwen3's vocabulary, 8 prompts x 8 samples x 64 new
tokens, micro-batches of 8 so DP=2 splits each minibatch); the two runs' checksums.jsonl compared byte for byte,
then `rlbench diff TP1 LAYOUT --rtol R --json`: where they part first and by how much, or that every recorded
value of every step agrees within R, and each value stage's largest difference over the run. R per dtype from
`--rtol` (default: float64 1e-12, the tolerance docs/usage.md states for TP=2 against TP=1 in float64; float32
1e-6 and bfloat16 1e-2, each just below its dtype's TP-order noise as this script measured it, so the output
shows where and by how much rounding parts the layouts: float32 1.9e-6 at 1.7B and 3.3e-6 at 4B, bf16 1.2e-2 and
1.4e-2, docs/usage.md). Each run's medians of perf/step_time, rollout_time and train_time after its first step.
`--layouts ''` makes the TP=1 reference alone (a host of one GPU can make it; the layouts' runs read it later).

Resumable across calls on one machine (a GPU host's 10-minute calls): every run's directory is kept under --out;
a run with all its steps committed is not run again, a run cut short continues with `--resume`.
`--drop-checkpoints` removes a run's checkpoints/ once all its steps are committed (the comparisons read its
checksums and recordings only): at 4B each run writes two checkpoints of ~64 GB (megatron's fp32 shards, the
model's safetensors, AdamW's moments), more than a four-GPU host's disk holds for three runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(BENCH)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]
import scale  # noqa: E402  (bench/scale.py: the shapes and the tokenizer of Qwen3's size)

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

from rlbench.config import load_config  # noqa: E402

DEFAULT_RTOL = {"float64": 1e-12, "float32": 1e-6, "bfloat16": 1e-2}


def layout(name: str) -> tuple[int, int]:
    """'tp2dp2' -> (2, 2); 'tp2' -> (2, 1); 'dp2' -> (1, 2); 'tp1' -> (1, 1)."""
    tp = int(name.split("tp")[1].split("dp")[0]) if "tp" in name else 1
    dp = int(name.split("dp")[1]) if "dp" in name else 1
    return tp, dp


def committed(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.is_file() else 0


def run(toml: Path, out: Path, tp: int, dp: int, device: str, steps: int, drop: bool = False) -> float:
    """One run to `steps` committed steps (continued where one was cut short); its wall seconds (0: already done).
    `drop`: its checkpoints removed once every step is committed."""
    seconds = 0.0 if committed(out) >= steps else _make(toml, out, tp, dp, device)
    if drop:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return seconds


def _make(toml: Path, out: Path, tp: int, dp: int, device: str) -> float:
    """`rlbench run` into `out` (`--resume` where it has committed steps); its wall seconds, or exit on failure."""
    command = [sys.executable, "-m", "rlbench.cli", "run"]
    if out.is_dir() and committed(out):
        command += ["--resume", str(out)]
    else:
        command += ["-c", str(toml), "--trainer", "megatron", "--tp", str(tp), "--dp", str(dp), "--deterministic"]
        command += ["--device", device, "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{out.name}: rlbench run exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return time.perf_counter() - start


def stages(out: Path) -> str:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()][1:]
    if not rows:
        return "one step only: no figure after the first"
    keys = ("perf/step_time", "perf/rollout_time", "perf/train_time")
    return ", ".join(f"{k[5:]} {statistics.median(r[k] for r in rows):.3f} s" for k in keys if k in rows[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.7B", choices=sorted(scale.SHAPES))
    parser.add_argument("--layouts", default="tp2dp2,tp2,dp2")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vocab", default=str(scale.QWEN3_VOCAB), help="vocab_size, or 'fixture'")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="runs/multi_gpu", help="where the runs are kept (resumable)")
    parser.add_argument(
        "--rtol",
        default="",
        help="DTYPE=R,... (defaults: " + ", ".join(f"{k}={v:g}" for k, v in DEFAULT_RTOL.items()) + ")",
    )
    parser.add_argument(
        "--drop-checkpoints", action="store_true", help="remove each run's checkpoints once all its steps are in"
    )
    args = parser.parse_args()
    rtol = {**DEFAULT_RTOL, **{k: float(v) for k, v in (p.split("=") for p in args.rtol.split(",") if p)}}
    root = Path(args.out).resolve() / args.shape
    root.mkdir(parents=True, exist_ok=True)
    vocab = None if args.vocab == "fixture" else int(args.vocab)
    model = root / args.shape
    if not model.is_dir():
        scale.model_dir(root, args.shape, vocab)
    tokenizer = root / "tokenizer"
    if vocab and not tokenizer.is_dir():
        scale.real_tokenizer(root)
    gpus = ""
    if args.device.startswith("cuda"):
        import torch

        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    print(f"{args.shape}, vocab {vocab or 'fixture'}, {args.steps} steps, device {args.device} {gpus}".rstrip())
    for dtype in args.dtypes.split(","):
        config = {
            "seed": 19,
            "steps": args.steps,
            "checkpoint_every": 10**6,
            "model": {
                "path": str(model),
                "tokenizer": str(tokenizer if vocab else load_config().model.tokenizer),
                "dtype": dtype,
                "init": "random",
            },
            "data": {"prompts_per_step": 8},
            "rollout": {"n_samples_per_prompt": 8, "max_new_tokens": args.new_tokens},
            "train": {"minibatches": 4, "micro_batch_size": 8},
        }
        toml = root / f"{dtype}.toml"
        toml.write_text(scale._toml(config))
        reference = root / f"{dtype}-tp1"
        seconds = run(toml, reference, 1, 1, args.device, args.steps, args.drop_checkpoints)
        print(f"  {dtype} tp1: {stages(reference)}" + (f" ({seconds:.0f} s wall)" if seconds else " (kept)"))
        for name in filter(None, args.layouts.split(",")):  # '': the TP=1 reference only
            tp, dp = layout(name)
            first, second = root / f"{dtype}-{name}-a", root / f"{dtype}-{name}-b"
            walls = [run(toml, out, tp, dp, args.device, args.steps, args.drop_checkpoints) for out in (first, second)]
            same = (first / "checksums.jsonl").read_bytes() == (second / "checksums.jsonl").read_bytes()
            diff = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "rlbench.cli",
                    "diff",
                    str(reference),
                    str(first),
                    "--rtol",
                    f"{rtol[dtype]:g}",
                    "--json",
                ],
                capture_output=True,
                text=True,
            )
            verdict = "error: " + diff.stderr.strip()[-300:]
            if diff.returncode in (0, 1):
                found = json.loads(diff.stdout)
                steps, stages_compared = len(found["steps_compared"]), len(found["stages_compared"])
                if diff.returncode == 0:
                    verdict = f"within rtol {rtol[dtype]:g}: {steps} steps x {stages_compared} stages compared"
                else:
                    f = found["first"]
                    verdict = (
                        f"parts from tp1 at rtol {rtol[dtype]:g}: step {f['step']}, {f['stage']}, {f['where']}, "
                        f"max abs {f['max_abs']}, max rel {f['max_rel']}"
                    )
                largest = found.get("largest") or {}
                verdict += "; largest over the run: " + (
                    ", ".join(
                        f"{stage} {v['max_abs']:.3g} abs"
                        + (
                            f" ({v['max_rel']:.3g} rel)" if v["max_rel"] is not None else ""
                        )  # as `rlbench diff` says it
                        + f" at step {v['step']}, {v['where']}"
                        for stage, v in largest.items()
                    )
                    or "none (every value stage bit for bit)"
                )
            print(
                f"  {dtype} {name} (TP={tp}, DP={dp}): two runs bit for bit: {same}; against tp1: {verdict}; "
                f"{stages(first)}" + (f" ({walls[0]:.0f} s, {walls[1]:.0f} s wall)" if all(walls) else "")
            )


if __name__ == "__main__":
    main()
