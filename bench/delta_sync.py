"""Bytes written per weight sync, full checkpoints against slime's delta sync (rlbench/core/weight_delta.py, issue 38).

    python bench/delta_sync.py [--steps 10] [--repeats 2] [--shape 0.6B] [--skip-run] [--skip-shape]

1. The default run against `rlbench serve` (`--rollout sglang --sglang-server rlbench`), as a user runs it: each
   mode in a process of its own, alternating full and delta `--repeats` times; from each run's metrics the bytes
   each sync wrote (`perf/update_weights_wire_bytes`, slime's metric: a full version's files, or a delta's) and
   the step time; whether the delta runs' checksums.jsonl equal the full runs' (they must: the same weights reach
   the servers).
2. At a real shape (Qwen3-0.6B's, random weights, Qwen3's vocabulary, in float32 on this CPU): what one optimizer
   step changes, published both ways. One AdamW step (slime's defaults: lr 1e-6, betas 0.9/0.999, eps 1e-8,
   weight decay 0.01) on a random batch of 2 x 64 tokens; the weights before and after exported in float32 (the
   CPU trainer's) and in bfloat16 (what a bf16 trainer exports), each published as a full version and as an xor
   delta (zstd level 1, xxh3-128), with the share of bytes that changed and the time to publish.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_runs(steps: int, repeats: int) -> None:
    rows = {"full": [], "delta": []}
    sums = {}
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(repeats):
            for mode in ("full", "delta"):
                out = Path(root) / f"{mode}-{repeat}"
                cmd = [sys.executable, "-m", "rlbench", "run", "--rollout", "sglang", "--sglang-server", "rlbench"]
                cmd += ["--steps", str(steps), "--out", str(out), "--update-weight-mode", mode, "--json"]
                done = subprocess.run(
                    cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
                )
                if done.returncode:
                    raise SystemExit(f"{mode} run failed: {done.stderr[-2000:]}")
                metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                rows[mode] += [(m["perf/update_weights_wire_bytes"], m["perf/step_time"]) for m in metrics]
                sums.setdefault(mode, set()).add((out / "checksums.jsonl").read_bytes())
    print(f"default run, {steps} steps x {repeats} runs per mode (alternating), rlbench serve over HTTP:")
    for mode, values in rows.items():
        wire = [w for w, _ in values]
        print(
            f"  {mode:5s}: {statistics.mean(wire):,.0f} bytes per sync (min {min(wire):,}, max {max(wire):,}); "
            f"step {statistics.median(t for _, t in values) * 1e3:.1f} ms (median)"
        )
    full, delta = (statistics.mean(w for w, _ in rows[m]) for m in ("full", "delta"))
    print(f"  delta / full bytes: {delta / full:.3f}")
    same = len(sums["full"] | sums["delta"]) == 1
    print(f"  checksums.jsonl of every run equal: {same}")


def shape_step(shape: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "bench"))
    from scale import QWEN3_VOCAB, SHAPES

    from rlbench.config import load_config
    from rlbench.core.weight_delta import Publisher

    fixture = json.loads(Path(load_config().model.path, "config.json").read_text())
    config = AutoConfig.for_model(**{**fixture, **SHAPES[shape], "vocab_size": QWEN3_VOCAB})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    names = [n for n, _ in model.named_parameters()]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = sum(p.numel() for p in before.values())
    tokens = torch.randint(0, QWEN3_VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    start = time.perf_counter()
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    stepped = time.perf_counter() - start
    del optimizer
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    del model
    print(f"\n{shape} shape ({params / 1e9:.3f}B parameters, vocab {QWEN3_VOCAB}): one AdamW step ({stepped:.0f} s)")
    with tempfile.TemporaryDirectory() as root:
        for dtype in (torch.float32, torch.bfloat16):
            old = {n: before[n].to(dtype) for n in names}
            new = {n: after[n].to(dtype) for n in names}
            publisher = Publisher(Path(root) / str(dtype), "xor", "xxh3-128")
            full = publisher.publish_full(1, old, Path(load_config().model.path) / "config.json")
            start = time.perf_counter()
            delta = publisher.publish(2, new)
            took = time.perf_counter() - start
            print(
                f"  {str(dtype).split('.')[-1]:8s}: full {full.wire_bytes:,} bytes; delta {delta.wire_bytes:,} bytes "
                f"(x{delta.wire_bytes / full.wire_bytes:.3f}; {delta.changed_bytes / delta.total_bytes:.1%} of bytes "
                f"changed, {delta.tensors} of {len(names)} tensors); published in {took:.1f} s"
            )
            del old, new, publisher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shape", default="0.6B")
    parser.add_argument("--skip-run", action="store_true")
    parser.add_argument("--skip-shape", action="store_true")
    args = parser.parse_args()
    if not args.skip_run:
        default_runs(args.steps, args.repeats)
    if not args.skip_shape:
        shape_step(args.shape)


if __name__ == "__main__":
    main()
