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
    return {
        "group_index": group,
        "index": index,
        "prompt": messages,
        "tokens": list(prompt) + response,
        "multimodal_inputs": None,
        "multimodal_train_inputs": None,
        "response": answer,
        "response_length": len(response),
        "label": "even" if number % 2 == 0 else "odd",
        "reward": reward,
        "loss_mask": [1] * len(response),
        "weight_versions": ["3"],
        "rollout_log_probs": [-0.5 - 0.1 * k for k in range(len(response))],
        "rollout_routed_experts": None,
        "remove_sample": False,
        "teacher_log_probs": None,
        "status": status,
        "metadata": {},
        "generate_function_path": None,
        "train_metadata": None,
        "session_id": None,
        "non_generation_time": 0.0,
        "spec_info": {
            "spec_accept_token_num": 0,
            "spec_draft_token_num": 0,
            "spec_verify_ct": 0,
            "completion_token_num": 0,
        },
        "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": len(prompt)},
    }


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
                samples.append(
                    slime_sample(
                        tok, g, g * group_size + j, number, answer, reward, "truncated" if j == 3 else "completed"
                    )
                )
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
    assert tensors["rollout_logprobs"][first.start : first.stop].tolist() == pytest.approx([-0.5, -0.6])
    assert tensors["loss_mask"][first.start : first.stop].tolist() == [1, 1]
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
    assert (
        "refused: the dump holds tests.cpu.test_import_slime.Status objects, which rlbench does not load" in proc.stderr
        and "weights_only=True" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "imp").exists()


class Tripwire:
    """Unpickling one writes its file: the proof that a dump holding one was never unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __setstate__(self, state):
        from pathlib import Path

        Path(state["path"]).write_text("unpickled")


class Reducer:
    """Pickled as a call of _write_marker(path), which unpickling would make."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return _write_marker, (self.path,)


def _write_marker(path):
    from pathlib import Path

    Path(path).write_text("called")


def _one_line_refusal(proc, path) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and str(path) in lines[0], proc.stderr
    assert "add_safe_globals" not in proc.stderr and "Traceback" not in proc.stderr
    return lines[0]


@pytest.mark.parametrize("protocol, zipped", [(2, True), (4, True), (2, False)])
def test_a_multimodal_dump_is_named_from_its_opcodes(tmp_path, protocol, zipped):
    """A dump whose samples hold PIL images (a multimodal slime rollout): named as such, from the pickle's GLOBAL
    (protocol 2, torch's default) or STACK_GLOBAL (protocol 4) opcodes, in torch's zip or legacy format, instead
    of torch's text that invites allowlisting the class."""
    from PIL import Image

    (path,) = write_dumps(tmp_path, rollout_ids=(0,))
    dump = torch.load(path, weights_only=True)
    dump["samples"][0]["multimodal_inputs"] = {"images": [Image.new("RGB", (2, 2), (255, 0, 0))]}
    torch.save(dump, path, pickle_protocol=protocol, _use_new_zipfile_serialization=zipped)
    # protocol 4 in a process of its own: torch warns of the protocol on stderr, which must stay one line
    proc = run_cli("import", "slime", str(path), "--out", str(tmp_path / "imp"), process=protocol == 4)
    line = _one_line_refusal(proc, path)
    assert line.endswith(
        "refused: the dump holds PIL.Image.Image objects (a multimodal dump; rlbench reads text rollouts)"
    ), line
    assert not (tmp_path / "imp").exists()


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_dump_holding_objects_is_named_and_nothing_in_it_runs(tmp_path, protocol):
    """Objects whose unpickling writes a file (through __setstate__, or a __reduce__ call): the refusal names what
    the pickle refers to, and neither file appears. The tripwires do fire when unpickled (checked on a pickle of
    their own, never the dump)."""
    import pickle

    fired = tmp_path / "fired"
    pickle.loads(pickle.dumps([Tripwire(fired), Reducer(tmp_path / "called")]))
    assert fired.read_text() == "unpickled" and (tmp_path / "called").read_text() == "called"
    (path,) = write_dumps(tmp_path, rollout_ids=(0,))
    dump = torch.load(path, weights_only=True)
    dump["samples"][0]["metadata"] = {"state": Tripwire(tmp_path / "setstate"), "call": Reducer(tmp_path / "reduce")}
    torch.save(dump, path, pickle_protocol=protocol)
    line = _one_line_refusal(run_cli("import", "slime", str(path), "--out", str(tmp_path / "imp")), path)
    assert (
        "refused: the dump holds tests.cpu.test_import_slime.Tripwire, tests.cpu.test_import_slime._write_marker "
        "objects, which rlbench does not load"
    ) in line, line
    assert not (tmp_path / "setstate").exists() and not (tmp_path / "reduce").exists()
    assert not (tmp_path / "imp").exists()


def test_where_the_opcodes_name_nothing_torchs_advice_to_allowlist_is_left_out(tmp_path, monkeypatch):
    from rlbench.replay import pickled

    (path,) = write_dumps(tmp_path, rollout_ids=(0,))
    dump = torch.load(path, weights_only=True)
    dump["samples"][0]["status"] = Status.COMPLETED
    torch.save(dump, path)
    monkeypatch.setattr(pickled, "refused_globals", lambda path: [])
    line = _one_line_refusal(run_cli("import", "slime", str(path), "--out", str(tmp_path / "imp")), path)
    assert line.endswith(
        "rlbench unpickles nothing else (Unsupported global: GLOBAL "
        "tests.cpu.test_import_slime.Status was not an allowed global by default.)"
    ), line


def test_the_opcode_reader_names_globals_and_runs_nothing(tmp_path):
    from rlbench.replay.pickled import pickle_globals, refused_globals

    path = tmp_path / "x.pt"
    torch.save({"t": torch.zeros(2), "w": Tripwire(tmp_path / "fired")}, path)
    assert "tests.cpu.test_import_slime.Tripwire" in pickle_globals(path)
    assert refused_globals(path) == ["tests.cpu.test_import_slime.Tripwire"]  # torch's own types are allowed
    assert not (tmp_path / "fired").exists()
    (tmp_path / "junk").write_bytes(b"not a pickle")
    assert pickle_globals(tmp_path / "junk") == []


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.update(loss_mask=[1]), "loss_mask: 1 values"),
        (lambda s: s.update(reward={"acc": 1.0}), "name one with --reward-key"),
        (lambda s: s.update(response_length=10**6), "response_length"),
        (lambda s: s.update(tokens=[10**6] + s["tokens"][1:]), "outside the tokenizer's vocabulary"),
    ],
)
def test_malformed_samples_are_named(tmp_path, mutate, message):
    (path,) = write_dumps(tmp_path, rollout_ids=(0,))
    dump = torch.load(path, weights_only=True)
    mutate(dump["samples"][2])
    torch.save(dump, path)
    proc = run_cli("import", "slime", str(path), "--out", str(tmp_path / "imp"))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "rollout_0.pt" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"hello", "not a torch.save file"),
        (b"", "empty file (0 bytes): not a torch.save file"),
        ("half", "not a torch.save file"),
    ],
)
def test_not_a_torch_file(tmp_path, content, needle):
    bad = tmp_path / "x.pt"
    if content == "half":  # a real dump cut short
        (dump,) = write_dumps(tmp_path, rollout_ids=(0,))
        content = dump.read_bytes()[: dump.stat().st_size // 2]
    bad.write_bytes(content)
    proc = run_cli("import", "slime", str(bad), "--out", str(tmp_path / "imp"))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0] and str(bad) in lines[0], proc.stderr
    assert not (tmp_path / "imp").exists()


# --------------------------------------------------------------------------- every field used, kept or refused


def _one_dump(tmp_path, edit) -> object:
    (path,) = write_dumps(tmp_path, rollout_ids=(0,))
    dump = torch.load(path, weights_only=True)
    edit(dump["samples"])
    torch.save(dump, path)
    return path


def test_fields_are_kept_in_the_metadata_as_json_and_what_replay_does_not_use_is_named(tmp_path):
    def edit(samples):
        samples[0].update(
            metadata={"raw_reward": 0.5, 7: ["a", (1, 2)]},
            session_id="s-0",
            my_field=torch.tensor([3]),
            reward={"acc": 1.0, "fmt": 0.5},
            teacher_log_probs=[-1.0, -2.0],
        )
        for s in samples[:4]:
            s["rollout_id"] = 11  # a compact rollout: four training samples of one rollout execution

    path = _one_dump(tmp_path, edit)
    proc = run_cli("import", "slime", str(path), "--out", str(tmp_path / "imp"), "--reward-key", "acc")
    assert proc.returncode == 0, proc.stderr
    assert "imported 1 rollout ids (8 samples, groups of 4)" in proc.stdout
    assert (
        "note: teacher_log_probs kept in 1 samples' metadata, not used by replay: on-policy distillation" in proc.stdout
    )
    assert "fields slime's Sample does not declare, kept in the samples' metadata: my_field" in proc.stdout
    assert "rollout id 0: 4 samples share a Sample.rollout_id with siblings (a compact rollout)" in proc.stdout
    tensors, meta = read_step(tmp_path / "imp", 0)
    kept = meta["samples"][0]["slime"]
    assert kept["metadata"] == {"raw_reward": 0.5, "7": ["a", [1, 2]]} and kept["my_field"] == [3]
    assert (kept["session_id"], kept["reward"], kept["rollout_id"]) == ("s-0", {"acc": 1.0, "fmt": 0.5}, 11)
    assert kept["spec_info"]["spec_verify_ct"] == 0 and kept["weight_versions"] == ["3"]
    assert "tokens" not in kept and "multimodal_inputs" not in kept  # used or refused: not kept twice
    assert meta["samples"][0]["reward"] == 1.0 == float(tensors["rewards"][0])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update(metadata={(1, 2): 3}), "samples[2].metadata: a key (1, 2) that JSON cannot keep"),
        (
            lambda s: s.update(rollout_top_p_token_ids=[1, 2]),
            "samples[2].rollout_top_p_token_offsets: None, while its pair is set",
        ),
        (
            lambda s: s.update(rollout_top_p_token_ids=[1, 2], rollout_top_p_token_offsets=[0, 2]),
            "samples[2].rollout_top_p_token_offsets: expected response_length + 1 = 3 non-decreasing offsets "
            "from 0 to 2",
        ),
        (lambda s: s.update(rollout_top_p_token_ids=[1, 2], rollout_top_p_token_offsets=[0, 2, 1]), "non-decreasing"),
        (
            lambda s: s.update(prompt=[{"role": "user", "content": [{"type": "image", "image": "x.png"}]}]),
            "samples[2].prompt[0].content: a 'image' part: multimodal samples are not supported",
        ),
        (
            lambda s: s.update(prompt=[{"role": "user", "content": 3}]),
            "samples[2].prompt[0].content: expected a string",
        ),
        (
            lambda s: s.update(multimodal_train_input_id="abc"),
            "samples[2].multimodal_train_input_id: set, and multimodal",
        ),
        (lambda s: s.update(status="done"), "samples[2].status: expected one of slime's statuses"),
        (lambda s: s.update(status={"nested": [1]}), "samples[2].status: expected one of slime's statuses"),
        (lambda s: s.update(remove_sample=1), "samples[2].remove_sample: expected true or false"),
        (
            lambda s: s.update(rollout_top_p_token_ids=[10**6, 2], rollout_top_p_token_offsets=[0, 1, 2]),
            "token id 1000000 is outside the tokenizer's vocabulary",
        ),
    ],
)
def test_what_cannot_be_imported_faithfully_is_refused_naming_the_field(tmp_path, edit, message):
    path = _one_dump(tmp_path, lambda samples: edit(samples[2]))
    proc = run_cli("import", "slime", str(path), "--out", str(tmp_path / "imp"))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "imp").exists()


def test_a_removed_sample_keeps_its_reward_in_its_group_and_replay_trains_without_it(tmp_path):
    path = _one_dump(tmp_path, lambda samples: samples[1].update(remove_sample=True))
    summary = import_slime_summary(path, tmp_path / "imp")
    assert summary["removed"] == 1 and summary["samples"] == 8
    tensors, meta = read_step(tmp_path / "imp", 0)
    a, b = int(tensors["offsets"][1]) + int(tensors["prompt_lengths"][1]), int(tensors["offsets"][2])
    assert tensors["loss_mask"][a:b].tolist() == [0, 0] and tensors["rewards"].numel() == 8
    assert [s["remove_sample"] for s in meta["samples"]] == [False, True] + [False] * 6
    assert replay(tmp_path / "imp", tmp_path / "rep").ok


def test_samples_without_logprobs_and_a_nucleus_are_flagged_per_sample(tmp_path):
    def edit(samples):
        samples[0]["rollout_log_probs"] = None
        samples[1].update(
            rollout_top_p_token_ids=torch.tensor([5, 6, 7], dtype=torch.int32),
            rollout_top_p_token_offsets=torch.tensor([0, 2, 3], dtype=torch.int32),
        )

    summary = import_slime_summary(_one_dump(tmp_path, edit), tmp_path / "imp")
    assert (summary["without_logprobs"], summary["top_p"]) == (1, 1)
    tensors, meta = read_step(tmp_path / "imp", 0)
    assert [(s["has_rollout_logprobs"], s["top_p"]) for s in meta["samples"][:3]] == [
        (False, False),
        (True, True),
        (True, False),
    ]
    offsets, start = tensors["top_p_offsets"], int(tensors["offsets"][1]) + int(tensors["prompt_lengths"][1])
    assert tensors["top_p_ids"].tolist() == [5, 6, 7] and offsets.numel() == tensors["tokens"].numel() + 1
    spans = [tensors["top_p_ids"][int(offsets[j]) : int(offsets[j + 1])].tolist() for j in range(start, start + 2)]
    assert spans == [[5, 6], [7]] and int(offsets[start]) == 0  # nothing before: no other sample has a nucleus


def import_slime_summary(path, out) -> dict:
    proc = run_cli("import", "slime", str(path), "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
