"""rlbench/replay/slime_dir.py called directly on small `--dump-details` directories built here (empty files where
only names are read): which files are read as rollout and train dumps, what is named and skipped, and Miles'
trajectory rows put back into the samples they name or refused naming file, line and field. The directories that
slime's and Miles' own writers made are imported whole in test_slime_train_dumps.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbench.errors import BadInput
from rlbench.replay.slime_dir import dump_directory, restore_trajectories


def _layout(root: Path, *names: str) -> Path:
    """Empty files, and directories where a name ends in /."""
    for name in names:
        if name.endswith("/"):
            (root / name).mkdir(parents=True)
        else:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).touch()
    return root


@pytest.mark.parametrize(
    ("names", "notes"),
    [
        pytest.param(["rollout_data/0.pt", "train_data/0.pt", "tokenizer/tokenizer.json"], [], id="nothing to say"),
        pytest.param(
            ["rollout_data/0.pt", "rollout_data/eval_0.pt", "rollout_data/eval_1.pt", "trajectory/eval_0.jsonl"],
            [
                "2 evaluation dumps (rollout_data/eval_<id>.pt) skipped: not training data",
                "no train_data/: the rollout side only",
            ],
            id="evaluation dumps, no train_data",
        ),
        pytest.param(
            ["rollout_data/0.pt", "train_data/", "dashboard_columns/rollout_0.parquet", "events/", "dashboard/"]
            + ["policy_loss_debug/"],
            [
                "dashboard_columns/ (Miles' parquet copy of the rollout dumps' per-token columns) not read",
                "events/ (Miles' event log) not read",
                "dashboard/ (Miles' dashboard telemetry) not read",
                "policy_loss_debug/ (Miles' per-call policy-loss dumps) not read",
            ],
            id="Miles' sidecars",
        ),
    ],
)
def test_what_a_dump_directory_skips_is_named_and_nothing_else_said(tmp_path, names, notes):
    """Evaluation dumps are counted and skipped (never a step), a missing train_data/ and each Miles sidecar not
    read are said, and a directory with nothing skipped gets no note."""
    rollouts, _, said = dump_directory(_layout(tmp_path, *names))
    assert rollouts == [tmp_path / "rollout_data" / "0.pt"]
    assert said == notes


def test_a_directory_without_rollout_data_is_refused_naming_it(tmp_path):
    """A directory with no rollout_data/ is not a `--dump-details` directory: refused, naming the directory."""
    with pytest.raises(BadInput) as refused:
        dump_directory(_layout(tmp_path, "train_data/0.pt"))
    assert str(refused.value) == f"{tmp_path}: not a slime --dump-details directory (no rollout_data/)"


def test_train_dumps_are_found_by_their_names_each_rollouts_in_rank_order(tmp_path):
    """train_data/{id}.pt (format 2) and {id}_{rank}.pt (format 1) are read, a rollout's ranks in numeric order
    (rank 10 after rank 9); no other file there is taken for a train dump."""
    ranks = [f"train_data/0_{rank}.pt" for rank in (11, 3, 10, 0, 2, 1, 9, 4, 8, 5, 7, 6)]
    strays = ["eval_0.pt", "0_1_2.pt", "notes.pt", "1_\u00b2.pt", "0_.pt", "3.json", "debug_train_0_0.pt"]
    _layout(tmp_path, "rollout_data/0.pt", "train_data/1.pt", *ranks, *(f"train_data/{name}" for name in strays))
    _, train, _ = dump_directory(tmp_path)
    assert train == {
        0: [tmp_path / "train_data" / f"0_{rank}.pt" for rank in range(12)],
        1: [tmp_path / "train_data" / "1.pt"],
    }


def test_a_rollout_with_train_dumps_in_both_formats_is_refused_naming_it(tmp_path):
    """A rollout id with both {id}.pt and {id}_{rank}.pt (two slime versions writing into one directory) is
    refused, naming every such rollout: which to read is not rlbench's guess."""
    names = ["train_data/0_0.pt", "train_data/0_1.pt", "train_data/1.pt", "train_data/1_0.pt", "train_data/2.pt"]
    _layout(tmp_path, "rollout_data/0.pt", *names, "train_data/2_0.pt", "train_data/2_1.pt", "train_data/3.pt")
    with pytest.raises(BadInput) as refused:
        dump_directory(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path / 'train_data'}: rollout 1, 2: train dumps in both of slime's formats, {{id}}.pt (format 2) and "
        "{id}_{rank}.pt (format 1): two slime versions' dumps in one directory? keep one"
    )


# Miles' trajectory rows (radixark/miles miles/ray/rollout/debug_data.py): one JSON object a line, the sample's index,
# group_index, status, reward (None where not a number), prompt and the conversation Miles popped from its metadata.


def _sample(index: int, **fields) -> dict:
    sample = {"index": index, "group_index": 3, "status": "completed", "prompt": "p", "reward": 1.0, "metadata": {}}
    return sample | fields


def _row(index: int, **fields) -> dict:
    messages = [{"role": "user", "content": "p"}, {"role": "assistant", "content": f"answer {index} \u00bd"}]
    row = {"sample_index": index, "group_index": 3, "status": "completed", "reward": 1.0, "prompt": "p"}
    return row | {"messages": messages} | fields


def _trajectory(directory: Path, rollout_id: int, content: bytes) -> Path:
    path = directory / "trajectory" / f"{rollout_id}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def _jsonl(*rows: dict) -> bytes:
    """As Miles writes them, but UTF-8 unescaped (JSON's own encoding, which a reader must take too)."""
    return "".join(json.dumps(row, separators=(",", ":"), ensure_ascii=False) + "\n" for row in rows).encode()


def test_each_trajectory_row_is_put_back_in_the_sample_it_names_and_only_there(tmp_path):
    """Each row's conversation goes to the metadata.messages of the sample whose index it names, in every rollout
    that has a trajectory file (a rollout without one is passed over); a sample without metadata gets it; a
    reward Miles wrote as null (not a number) is not compared; the note counts the samples restored."""
    dumps = [
        {"rollout_id": 0, "samples": [_sample(0)]},
        {"rollout_id": 1, "samples": [_sample(4), _sample(5, metadata={"turns": 2}), _sample(6)]},
        {"rollout_id": 2, "samples": [_sample(8, reward={"score": 1.0}), _sample(9)]},
    ]
    del dumps[1]["samples"][2]["metadata"]
    loaded = [(dump, tmp_path / "rollout_data" / f"{dump['rollout_id']}.pt") for dump in dumps]
    assert restore_trajectories(tmp_path, loaded) == []  # no trajectory/: nothing restored, nothing said
    _trajectory(tmp_path, 1, _jsonl(_row(6), _row(5)))
    _trajectory(tmp_path, 2, _jsonl(_row(8, reward=None)))
    assert restore_trajectories(tmp_path, loaded) == [
        "Miles' trajectory/ conversations of 3 samples put back in their metadata.messages"
    ]
    metadata = {s["index"]: s.get("metadata") for dump in dumps for s in dump["samples"]}
    assert metadata == {
        0: {},
        4: {},
        5: {"turns": 2, "messages": _row(5)["messages"]},
        6: {"messages": _row(6)["messages"]},
        8: {"messages": _row(8)["messages"]},
        9: {},
    }


@pytest.mark.parametrize(
    ("content", "sample", "says"),
    [
        pytest.param(
            _jsonl(_row(7)) + b"{oops\n",
            {},
            "invalid JSON on line 2 (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
            id="not JSON",
        ),
        pytest.param(
            b"\xff\n",
            {},
            "invalid JSON on line 1 ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte)",
            id="not UTF-8",
        ),
        pytest.param(b"[" * 100_000 + b"\n", {}, "invalid JSON on line 1: nested too deeply", id="nested too deeply"),
        pytest.param(b"[7]\n", {}, "line 1, messages: expected an object with a list of messages", id="not an object"),
        pytest.param(
            _jsonl(_row(7, messages="hello")),
            {},
            "line 1, messages: expected an object with a list of messages",
            id="messages not a list",
        ),
        pytest.param(
            _jsonl(_row(7, turns=2, score=0.5)),
            {},
            "line 1: fields Miles' trajectory rows do not hold: score, turns",
            id="fields Miles does not write",
        ),
        pytest.param(
            _jsonl(_row(7), _row(70)),
            {},
            "line 2, sample_index: 70 is no sample of rollout_data/1.pt",
            id="no such sample",
        ),
        pytest.param(
            _jsonl(_row(7, sample_index=[7])),
            {},
            "line 1, sample_index: [7] is no sample of rollout_data/1.pt",
            id="a list as sample_index",
        ),
        pytest.param(
            _jsonl(_row(7, sample_index=7.0)),
            {},
            "line 1, sample_index: 7.0 is no sample of rollout_data/1.pt",
            id="a float as sample_index, not the sample of index 7",
        ),
        pytest.param(
            _jsonl(_row(7, group_index=4)),
            {},
            "line 1, group_index: 4 differs from the sample's in the rollout dump (3)",
            id="another group",
        ),
        pytest.param(
            _jsonl(_row(7, status="aborted")),
            {},
            "line 1, status: 'aborted' differs from the sample's in the rollout dump ('completed')",
            id="another status",
        ),
        pytest.param(
            _jsonl(_row(7, prompt="q")),
            {},
            "line 1, prompt: 'q' differs from the sample's in the rollout dump ('p')",
            id="another prompt",
        ),
        pytest.param(
            _jsonl(_row(7, reward=0.5)),
            {},
            "line 1, reward: 0.5 differs from the sample's in the rollout dump (1.0)",
            id="another reward",
        ),
        pytest.param(
            _jsonl(_row(7)),
            {"metadata": {"messages": []}},
            "line 1, messages: the sample already holds metadata.messages",
            id="messages already there",
        ),
        pytest.param(
            _jsonl(_row(7)),
            {"metadata": ""},
            "line 1, messages: the sample already holds metadata.messages",
            id="metadata not a dict",
        ),
    ],
)
def test_a_trajectory_row_that_does_not_fit_its_sample_is_refused_naming_file_line_and_field(
    tmp_path, content, sample, says
):
    """A trajectory line that is not a JSON object with a list of messages, holds a field Miles does not write,
    names no sample of its rollout, disagrees with its sample, or would overwrite a conversation is refused in
    one line naming the file, the line and the field."""
    path = _trajectory(tmp_path, 1, content)
    dump = {"rollout_id": 1, "samples": [_sample(6), _sample(7, **sample)]}
    with pytest.raises(BadInput) as refused:
        restore_trajectories(tmp_path, [(dump, tmp_path / "rollout_data" / "1.pt")])
    assert str(refused.value) == f"{path}: {says}"
