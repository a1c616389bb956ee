"""Issue 34's first acceptance point at a real size, as a user types it: a Qwen3-shaped model whose vocabulary
(151,936 logits) exceeds its tokenizer's (151,669 ids: the fixture tokenizer grown offline, bench/scale.py), random
bf16 weights, deterministic; `rlbench run` with the torch trainer, the megatron trainer and `--rollout sglang
--sglang-server rlbench`, then every reader on what each wrote: `check logprobs`, `check tito`, `replay`, `diff`
(the run against its replay) and `report`. `check logprobs` holds the train-inference mismatch to slime CI's
bound (`--max-mean 0.1`): an engine whose log-probs leave the trainer's fails here, not only a check that
refuses the recording. Each command runs in a process of its own; the script prints its
exit code, its first and last lines, and how many padded ids (tokenizer size <= id < vocab size) each run
recorded: random weights sample them a few times in a thousand, so 2 x 64 samples x 256 tokens hold dozens.

    python bench/real_vocab_checks.py [--shape 0.6B] [--device cuda] [--steps 2] [--new-tokens 256]
                                      [--runs torch,megatron,sglang] [--keep DIR]

`--shape fixture --device cpu --new-tokens 8` checks the script itself on the CPU in a minute (the fixture model at
Qwen3's vocabulary). Exit 0 when every command exited 0 and every run recorded at least one padded id; else 1.
With `--keep DIR` it resumes: a command that exited 0 there before (DIR/done.jsonl) is not run again, so a GPU
host's 10-minute calls can carry it on. The SGLang run's packages (sglang-router, the client's and the server's) are
asked for before anything runs, as `rlbench run` asks for them (rlbench/backends/registry.py, check_installed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from scale import QWEN3_TOKENIZER, QWEN3_VOCAB, _toml, model_dir, real_tokenizer  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

from rlbench.backends.registry import check_installed  # noqa: E402
from rlbench.config import apply_overrides, load_config  # noqa: E402
from rlbench.errors import BadInput  # noqa: E402

RUNS = {
    "torch": [],
    "megatron": ["--trainer", "megatron"],
    "sglang": ["--rollout", "sglang", "--sglang-server", "rlbench"],
}
SGLANG_OVERRIDES = {"rollout__backend": "sglang", "rollout__sglang_server": "rlbench"}  # RUNS["sglang"] as fields


def rlbench(done_log: Path, kept: set[str], *args: str) -> int:
    """`rlbench ARGS` in its own process, unless it exited 0 before (`kept`, read from done_log); its exit code,
    appended to done_log. A run or replay cut short before (its directory there, no exit recorded) continues:
    `run --resume`, or the replay made again."""
    key = " ".join(args)
    if key in kept:
        print(f"  exit 0 (kept)  rlbench {key}", flush=True)
        return 0
    out = Path(args[args.index("--out") + 1]) if "--out" in args else None
    if args[0] == "run" and out is not None and (out / "manifest.json").is_file():
        args = ("run", "--resume", str(out))
    elif args[0] == "replay" and out is not None and out.exists():
        shutil.rmtree(out)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rlbench", *args], capture_output=True, text=True)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    print(f"  exit {done.returncode} ({time.perf_counter() - start:5.1f} s)  rlbench {' '.join(args)}", flush=True)
    for line in dict.fromkeys(lines[:1] + lines[-1:]):  # the verdict (its first line) and the last
        print(f"      {line[:200]}", flush=True)
    with done_log.open("a") as log:
        log.write(json.dumps({"command": key, "exit": done.returncode}) + "\n")
    return done.returncode


def padded(run: Path) -> int:
    from rlbench.rundir.recording import read_step

    steps = sorted(int(p.stem) for p in (run / "rollouts").glob("*.safetensors"))
    tokens = [read_step(run, step)[0]["tokens"] for step in steps]
    return sum(int(((t >= QWEN3_TOKENIZER) & (t < QWEN3_VOCAB)).sum()) for t in tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6B")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", default="torch,megatron,sglang")
    parser.add_argument("--keep", type=Path, help="write the runs here (default: a temporary directory)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="real-vocab-"))
    root.mkdir(parents=True, exist_ok=True)
    done_log = root / "done.jsonl"
    done_log.touch()
    kept = {r["command"] for r in map(json.loads, done_log.read_text().splitlines()) if r["exit"] == 0}
    config = {
        "steps": args.steps,
        "device": args.device,
        "deterministic": True,
        "model": {
            "path": str(
                root / args.shape if (root / args.shape).is_dir() else model_dir(root, args.shape, QWEN3_VOCAB)
            ),
            "tokenizer": str(root / "tokenizer" if (root / "tokenizer").is_dir() else real_tokenizer(root)),
            "dtype": "bfloat16",
            "init": "random",
        },
        "data": {"prompts_per_step": 8},
        "rollout": {"n_samples_per_prompt": 8, "max_new_tokens": args.new_tokens},
        "train": {"minibatches": 4, "micro_batch_size": 16},
    }
    (root / "run.toml").write_text(_toml(config))
    if "sglang" in args.runs.split(","):
        try:  # what `rlbench run --rollout sglang --sglang-server rlbench` asks first, asked before any run starts
            check_installed(apply_overrides(load_config(root / "run.toml"), **SGLANG_OVERRIDES))
        except BadInput as exc:
            print(f"the sglang run cannot start here: {exc} (or leave it out: --runs)")
            return 1
    failed = []
    for name in args.runs.split(","):
        run = root / name
        print(f"{name}: {args.shape} shape, vocab {QWEN3_VOCAB}, tokenizer {QWEN3_TOKENIZER} ids, {args.device}")
        commands = [
            ["run", "-c", str(root / "run.toml"), *RUNS[name], "--out", str(run)],
            ["check", "logprobs", str(run), "--max-mean", "0.1"],  # slime CI's bound on the mismatch
            ["check", "tito", str(run)],
            ["replay", str(run), "--out", str(root / f"{name}-replay")],
            ["diff", str(run), str(root / f"{name}-replay")],
            ["report", str(run), "--out", str(root / f"{name}.html")],
        ]
        for command in commands:
            code = rlbench(done_log, kept, *command)
            if code != 0:
                failed.append(f"{name}: rlbench {command[0]} {command[1]} exited {code}")
            if command[0] == "run" and code == 0:
                count = padded(run)
                manifest = json.loads((run / "manifest.json").read_text())
                print(f"      padded ids recorded: {count}; manifest vocab: {manifest.get('vocab')}")
                if count == 0:
                    failed.append(f"{name}: no padded id recorded (nothing of point 1 exercised)")
            if command[0] == "run" and code != 0:
                break
    print("every command exited 0 and every run recorded padded ids" if not failed else "\n".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
