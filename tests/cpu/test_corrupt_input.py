"""Corrupted recordings are bad input: one clear line naming the file, exit 2, no traceback, and
nothing written (the source is untouched, the replay directory is never created)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import REPO, run_cli
from tests.cpu.recordings import copy_run


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    from rlbench.config import load_config
    from rlbench.session import run

    root = tmp_path_factory.mktemp("orig")
    run(
        load_config(
            out=str(root / "a"),
            steps=3,
            data__prompts_per_step=2,
            rollout__n_samples_per_prompt=2,
            train__minibatches=1,
            train__micro_batch_size=4,
        )
    )
    return root / "a"


def _truncate(run):
    path = run / "rollouts" / "000001.safetensors"
    path.write_bytes(path.read_bytes()[:-40])
    return "000001.safetensors"


def _flip_tensor_byte(run):
    path = run / "rollouts" / "000002.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's data
    path.write_bytes(bytes(data))
    return "000002.safetensors"


def _flip_json_byte(run):
    path = run / "rollouts" / "000000.json"
    text = path.read_text()
    i = text.index('"response": "') + len('"response": "')
    path.write_text(text[:i] + ("X" if text[i] != "X" else "Y") + text[i + 1 :])
    return "000000.json"


def _remove(run):
    (run / "rollouts" / "000001.json").unlink()
    return "000001.json"


def _schema(run):
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["schema"] = "rlbench.run/0"
    (run / "manifest.json").write_text(json.dumps(manifest))
    return "schema"


def _older_checksums(run):
    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["checksum"]  # as an rlbench before wordsum/1 wrote it: sha256, not named
    (run / "manifest.json").write_text(json.dumps(manifest))
    return "written with sha256 checksums by an older rlbench"


def _other_tokenizer(run):
    tok = run.parent / f"{run.name}-tok"
    shutil.copytree(REPO / "rlbench" / "fixtures" / "tokenizers" / "qwen-tiny", tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("\\n", " ")
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["model"]["tokenizer"] = str(tok)
    (run / "manifest.json").write_text(json.dumps(manifest))
    return "another tokenizer"


CASES = {
    "truncated safetensors": _truncate,
    "flipped byte in tensors": _flip_tensor_byte,
    "flipped byte in JSON": _flip_json_byte,
    "missing rollout file": _remove,
    "wrong schema version": _schema,
    "recording made with another tokenizer": _other_tokenizer,
    "checksums of an older rlbench": _older_checksums,
}


def _snapshot(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", ["replay", "train-only"])
def test_corruption_is_bad_input(original, tmp_path, case, command):
    broken = copy_run(original, tmp_path / "broken")
    expected = CASES[case](broken)
    before = _snapshot(broken)
    out = tmp_path / "out"
    if command == "replay":
        proc = run_cli("replay", str(broken), "--out", str(out))
    else:
        # the trainer settings are the command's: minibatches pinned to the recording's 1, a divisor of its 4 samples
        # a step (the default's 8 is not), so that the corruption is what is refused
        config = tmp_path / "c.toml"
        config.write_text("[train]\nminibatches = 1\n")
        proc = run_cli("run", "-c", str(config), "--mode", "train-only", "--rollouts", str(broken), "--out", str(out))
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlbench: error:"), proc.stderr
    assert expected in lines[0] and "Traceback" not in proc.stderr
    assert _snapshot(broken) == before
    assert not out.exists()


def test_diff_refuses_a_corrupt_manifest(original, tmp_path):
    broken = copy_run(original, tmp_path / "broken")
    (broken / "manifest.json").write_text("{not json")
    proc = run_cli("diff", str(original), str(broken))
    assert proc.returncode == 2 and "manifest.json" in proc.stderr and "Traceback" not in proc.stderr
