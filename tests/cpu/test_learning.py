"""The acceptance run: `rlbench run` with no arguments learns. Mean rollout/raw_reward of the
last 10 steps beats the first 10 by at least 0.3. (Its wall time is a bench/ figure, not a test.)"""

from __future__ import annotations

import json
import statistics

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    proc = run_cli("run", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(100))
    rewards = [r["rollout/raw_reward"] for r in rows]
    assert all(0.0 <= r <= 1.0 for r in rewards)
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    assert last - first >= 0.3, (first, last)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == \
        ["000000", "000025", "000050", "000075", "000100"]
    assert len(list((run_dir / "rollouts").glob("*.safetensors"))) == 100
