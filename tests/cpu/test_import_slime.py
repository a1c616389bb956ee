"""`rlbench import slime`: dumps in slime's own format (built here, offline) become a recording
that replay, train-only and diff accept; anything that would need unpickling is refused."""

from __future__ import annotations

import enum
import json

import pytest
import torch

from rlbench.core.model import load_tokenizer
from rlbench.replay.diff import diff
from rlbench.rundir.recording import read_step
from rlbench.replay.replay import replay
from tests.conftest import REPO, run_cli

TOKENIZER = REPO / "rlbench" / "fixtures" / "tokenizers" / "qwen-tiny"


def slime_sample(tok, group: int, index: int, number: int, answer: str, reward: float, status="completed") -> dict:
    """Shaped like slime's Sample.to_dict() (slime/utils/types.py)."""
    messages = [{"role": "user", "content": f"Is {number} even or odd?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    response = tok.encode(answer) + [tok.eos_token_id]
    return {"group_index": group, "index": index, "prompt": messages, "tokens": list(prompt) + response,
            "multimodal_inputs": None, "multimodal_train_inputs": None, "response": answer,
            "response_length": len(response), "label": "even" if number % 2 == 0 else "odd", "reward": reward,
            "loss_mask": [1] * len(response), "weight_versions": ["3"],
            "rollout_log_probs": [-0.5 - 0.1 * k for k in range(len(response))], "rollout_routed_experts": None,
            "remove_sample": False, "teacher_log_probs": None, "status": status, "metadata": {},
            "generate_function_path": None, "train_metadata": None, "session_id": None, "non_generation_time": 0.0,
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                          "completion_token_num": 0},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": len(prompt)}}


def write_dumps(directory, rollout_ids=(0, 1, 2), groups=2, group_size=4):
    tok = load_tokenizer(TOKENIZER)
    paths = []
    for rid in rollout_ids:
        samples = []
        for g in range(groups):
            number = 10 * rid + g
            for j in range(group_size):
                answer = ["even", "odd"][(j + g) % 2]
                reward = 1.0 if answer == ("even" if number % 2 == 0 else "odd") else 0.0
                samples.append(slime_sample(tok, g, g * group_size + j, number, answer, reward,
                                            "truncated" if j == 3 else "completed"))
        path = directory / f"rollout_{rid}.pt"
        torch.save({"rollout_id": rid, "samples": samples}, path)
        paths.append(path)
    return paths


def test_import_then_replay_and_diff(tmp_path):
    dumps = write_dumps(tmp_path)
    proc = run_cli("import", "slime", *map(str, reversed(dumps)), "--out", str(tmp_path / "imp"), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["steps"] == 3 and summary["group_size"] == 4 and summary["rollout_ids"] == [0, 1, 2]
    tensors, meta = read_step(tmp_path / "imp", 1)
    assert [s["rollout_id"] for s in meta["samples"]] == [1] * 8
    assert [s["finish_reason"] for s in meta["samples"][:4]] == ["stop", "stop", "stop", "length"]
    first = range(int(tensors["offsets"][0]) + int(tensors["prompt_lengths"][0]), int(tensors["offsets"][1]))
    assert tensors["rollout_logprobs"][first.start:first.stop].tolist() == pytest.approx([-0.5, -0.6])
    assert tensors["loss_mask"][first.start:first.stop].tolist() == [1, 1]
    res = replay(tmp_path / "imp", tmp_path / "rep")
    assert res.ok and res.reproduced == 3  # the recording's own stages verified, then trained on
    assert diff(tmp_path / "imp", tmp_path / "rep").first is None  # compares the stages both have
    # ... and finds where two imports part: one log-prob of rollout 1's sample 5, response token 1
    from rlbench.config import ModelConfig
    from rlbench.replay.slime import import_slime

    (tmp_path / "edited").mkdir()
    edited = write_dumps(tmp_path / "edited")
    dump = torch.load(edited[1], weights_only=True)
    dump["samples"][5]["rollout_log_probs"][1] = -0.9
    torch.save(dump, edited[1])
    import_slime(edited, tmp_path / "imp2", ModelConfig(), model_given=False)
    first = diff(tmp_path / "imp", tmp_path / "imp2").first
    assert (first.step, first.stage, first.count) == (1, "rollout_logprobs", 1)
    assert "sample 5" in first.where and "response token 1" in first.where, first.where
    assert (first.a, first.b) == (pytest.approx(-0.6), pytest.approx(-0.9))


class Status(enum.Enum):
    COMPLETED = "completed"


def test_a_dump_that_needs_unpickling_is_refused(tmp_path):
    (path,) = write_dumps(tmp_path, rollout_ids=(0,))
    dump = torch.load(path, weights_only=True)
    dump["samples"][0]["status"] = Status.COMPLETED  # an object: loading it would run arbitrary code paths
    torch.save(dump, path)
    proc = run_cli("import", "slime", str(path), "--out", str(tmp_path / "imp"))
    assert proc.returncode == 2, proc.stderr
    assert "refused" in proc.stderr and "weights_only=True" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "imp").exists()


@pytest.mark.parametrize("mutate, message", [
    (lambda s: s.update(loss_mask=[1]), "loss_mask: 1 values"),
    (lambda s: s.update(reward={"acc": 1.0}), "name one with --reward-key"),
    (lambda s: s.update(response_length=10**6), "response_length"),
    (lambda s: s.update(tokens=[10**6] + s["tokens"][1:]), "outside the tokenizer's vocabulary"),
])
def test_malformed_samples_are_named(tmp_path, mutate, message):
    (path,) = write_dumps(tmp_path, rollout_ids=(0,))
    dump = torch.load(path, weights_only=True)
    mutate(dump["samples"][2])
    torch.save(dump, path)
    proc = run_cli("import", "slime", str(path), "--out", str(tmp_path / "imp"))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "rollout_0.pt" in proc.stderr and "Traceback" not in proc.stderr


def test_not_a_torch_file(tmp_path):
    bad = tmp_path / "x.pt"
    bad.write_text("hello")
    proc = run_cli("import", "slime", str(bad), "--out", str(tmp_path / "imp"))
    assert proc.returncode == 2 and "not a torch.save file" in proc.stderr
