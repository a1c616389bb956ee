"""Build the example files the commands of docs/usage.md name, offline: python examples/build.py [--golden]

- slime-dumps/rollout_{0,1}.pt: two rollout ids in slime's --save-debug-rollout-data format (a
  torch.save of {"rollout_id", "samples": [Sample.to_dict(), ...]}), tokenised with the fixture
  tokenizer; `rlbench import slime` reads them with torch.load(weights_only=True).
- golden_values_dev_cpu.json (--golden): a Megatron-LM golden values file ("lm loss" per iteration,
  iteration k = rlbench step k-1) made from `rlbench run --steps 10`, the default run, so the
  docs/golden.md's `check golden ... --rename "lm loss=train/loss"` compares a real series. Remade, like
  golden/, only when the default run's numbers move on purpose.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _sample(tok, group: int, index: int, number: int, answer: str) -> dict:
    """One sample shaped like slime's Sample.to_dict() (slime/utils/types.py)."""
    messages = [{"role": "user", "content": f"Is {number} even or odd?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    response = tok.encode(answer) + [tok.eos_token_id]
    label = "even" if number % 2 == 0 else "odd"
    return {
        "group_index": group,
        "index": index,
        "prompt": messages,
        "tokens": list(prompt) + response,
        "response": answer,
        "response_length": len(response),
        "label": label,
        "reward": 1.0 if answer == label else 0.0,
        "loss_mask": [1] * len(response),
        "rollout_log_probs": [round(-0.2 - 0.05 * k, 4) for k in range(len(response))],
        "weight_versions": [str(index // 8)],
        "status": "completed",
        "metadata": {},
    }


def build_dumps(out: Path) -> list[Path]:
    import torch

    from rlbench.core.model import load_tokenizer

    tok = load_tokenizer(REPO / "rlbench" / "fixtures" / "tokenizers" / "qwen-tiny")
    paths = []
    for rollout_id in (0, 1):
        samples = [
            _sample(tok, g, g * 4 + j, 10 * rollout_id + g + 2, ("even", "odd")[(j + g) % 2])
            for g in range(2)
            for j in range(4)
        ]
        path = out / "slime-dumps" / f"rollout_{rollout_id}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": rollout_id, "samples": samples}, path)
        paths.append(path)
    return paths


def build_golden(out: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        subprocess.run(
            [sys.executable, "-m", "rlbench.cli", "run", "--steps", "10", "--out", str(run), "--json"],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    values = {str(r["step"] + 1): r["train/loss"] for r in rows}
    doc = {"lm loss": {"start_step": 1, "end_step": len(rows), "step_interval": 1, "values": values}}
    path = out / "golden_values_dev_cpu.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", action="store_true", help="also remake golden_values_dev_cpu.json (runs rlbench)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    for path in build_dumps(HERE):
        print(path.relative_to(REPO))
    if args.golden:
        print(build_golden(HERE).relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
