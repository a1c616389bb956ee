"""`rlbench export RUN --out DIR` (issue 53): a checkpoint of either trainer as a directory transformers loads with
`from_pretrained` (offline, no remote code), whose logits are the trained model's bit for bit and which generates;
and the refusals, each exit 2 with nothing written: an existing DIR, a step with no checkpoint, weights that do
not match the run's checksums, a tokenizer other than the run's, a rollout-only run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlbench.config import apply_overrides
from tests.conftest import run_cli

PROMPT = [{"role": "user", "content": "What is 12 + 7?"}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_config) -> Path:
    """Two steps of the small config with each trainer (checkpoints 0 and 2)."""
    from rlbench.session import run

    root = tmp_path_factory.mktemp("export")
    for backend in ("torch", "megatron"):
        run(apply_overrides(small_config, steps=2, train__backend=backend, out=str(root / backend)))
    return root


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_an_exported_checkpoint_loads_in_transformers_with_the_trained_logits(runs, tmp_path, backend):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbench.core.model import build_model, load_named_, load_safetensors

    proc = run_cli("export", str(runs / backend), "--out", str(tmp_path / "hf"), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["steps_done"], doc["dtype"]) == (2, "float32")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(doc["files"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True, trust_remote_code=False)
    config = json.loads((runs / backend / "manifest.json").read_text())["config"]
    trained = build_model(config["model"]["path"], config["seed"], init=config["model"]["init"])
    load_named_(trained, load_safetensors(runs / backend / "checkpoints" / "000002" / "model.safetensors"))
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, trained.eval()(input_ids=ids).logits)  # bit for bit
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1] and isinstance(tokenizer.decode(out[0, ids.shape[1] :]), str)


def test_the_initial_checkpoint_is_exported_on_request_and_a_missing_one_is_refused(runs, tmp_path):
    proc = run_cli("export", str(runs / "torch"), "--out", str(tmp_path / "hf0"), "--step", "0")
    assert proc.returncode == 0 and "checkpoint after 0 steps" in proc.stdout, proc.stderr
    proc = run_cli("export", str(runs / "torch"), "--out", str(tmp_path / "hf1"), "--step", "1")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "rlbench: error: --step: no checkpoint after 1 steps; the run has checkpoints after 0, 2 steps"
    ]
    again = run_cli("export", str(runs / "torch"), "--out", str(tmp_path / "hf0"))
    assert again.returncode == 2 and "exists: give a new directory" in again.stderr
    assert not (tmp_path / "hf1").exists()


def _refused(run: Path, out: Path) -> str:
    proc = run_cli("export", str(run), "--out", str(out))
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.export-*"))
    return proc.stderr


def test_damaged_weights_or_another_tokenizer_are_refused_with_nothing_written(runs, tmp_path):
    flipped = shutil.copytree(runs / "torch", tmp_path / "flipped")
    weights = flipped / "checkpoints" / "000002" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0x01
    weights.write_bytes(bytes(raw))
    assert str(weights) in _refused(flipped, tmp_path / "a")
    other = shutil.copytree(runs / "torch", tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["hashes"]["tokenizer"] = "0" * 64  # as if the tokenizer directory had changed since the run
    (other / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    assert "made with another tokenizer" in _refused(other, tmp_path / "b")


def test_a_rollout_only_run_has_nothing_to_export(run_small, tmp_path):
    run_small("rollouts", mode="rollout-only", steps=1)
    assert "a rollout-only run trains nothing" in _refused(tmp_path / "rollouts", tmp_path / "hf")
