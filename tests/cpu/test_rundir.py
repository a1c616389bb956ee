"""The run directory and what it is built from: atomic writes, committed-step reading, the prompt
cursor, the flat recording layout and weight digests (seed derivation: test_seeding.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbench.core.data import PromptCursor
from rlbench.core.samples import flatten
from rlbench.core.types import Prompt, Sample
from rlbench.errors import BadInput
from rlbench.rundir import recording
from rlbench.rundir.digest import weights_digest
from rlbench.rundir.algorithm import CHECKSUM
from rlbench.rundir.directory import SCHEMA, RunWriter, read_run
from rlbench.rundir.writes import atomic_write

PROPERTY = settings(max_examples=50, deadline=None, database=None)  # hermetic: no .hypothesis/
MANIFEST = {
    "schema": SCHEMA,
    "checksum": CHECKSUM,
    "config": {"seed": 1},
    "mode": "full",
    "stages": ["data", "rollout", "reward"],
}


def _write_run(root, steps=3):
    writer = RunWriter(root, MANIFEST, record=False)
    for step in range(steps):
        writer.commit_step(step, {}, [], {"data": f"{step:064x}"}, {"train/loss": float(step)})
    writer.close()  # commits are queued on the writer's thread; close() lands them
    return writer


# ---------------------------------------------------------------- atomic_write


def test_atomic_write_replaces_content_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "file.json"
    atomic_write(target, b"old")
    atomic_write(target, b"new content")
    assert target.read_bytes() == b"new content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.json"]


# ---------------------------------------------------------------- read_run


def test_read_run_reads_committed_steps(tmp_path):
    _write_run(tmp_path / "run")
    run = read_run(tmp_path / "run")
    assert run.steps == [0, 1, 2]
    assert [row["step"] for row in run.checksums] == [0, 1, 2]
    assert run.manifest == MANIFEST
    assert run.notes == []


def test_read_run_ignores_torn_last_metrics_line(tmp_path):
    root = tmp_path / "run"
    _write_run(root)
    with open(root / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step":3,"train/loss":3.0}')  # complete JSON, but no newline: not committed
    run = read_run(root)
    assert run.steps == [0, 1, 2]
    assert any("metrics.jsonl" in note and "torn" in note for note in run.notes)


def test_read_run_ignores_checksums_past_last_committed_step(tmp_path):
    root = tmp_path / "run"
    _write_run(root)
    with open(root / "checksums.jsonl", "ab") as fh:
        fh.write(b'{"step":3,"data":"ab"}\n')
    run = read_run(root)
    assert [row["step"] for row in run.checksums] == [0, 1, 2]
    assert any("checksums.jsonl" in note and "[3]" in note for note in run.notes)


def test_read_run_rejects_wrong_schema(tmp_path):
    root = tmp_path / "run"
    _write_run(root)
    (root / "manifest.json").write_text(json.dumps({**MANIFEST, "schema": "rlbench.run/0"}))
    with pytest.raises(BadInput) as info:
        read_run(root)
    message = str(info.value)
    assert "schema" in message and "rlbench.run/0" in message and info.value.field == "schema"
    assert str(root / "manifest.json") in message
    assert info.value.path == str(root / "manifest.json")


def test_read_run_rejects_missing_manifest(tmp_path):
    root = tmp_path / "run"
    _write_run(root)
    (root / "manifest.json").unlink()
    with pytest.raises(BadInput, match="manifest.json") as info:
        read_run(root)
    assert info.value.path == str(root)


def test_run_writer_refuses_non_empty_non_run_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(BadInput, match="not empty"):
        RunWriter(tmp_path, MANIFEST)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing was written


def test_run_writer_refuses_existing_run(tmp_path):
    _write_run(tmp_path / "run")
    with pytest.raises(BadInput, match="already holds"):
        RunWriter(tmp_path / "run", MANIFEST)


# ---------------------------------------------------------------- PromptCursor


@PROPERTY
@given(
    st.integers(1, 13),
    st.integers(1, 5),
    st.integers(0, 2**63 - 1),
    st.lists(st.integers(0, 40), min_size=1, max_size=8),
)
def test_cursor_indices_are_a_pure_function_of_step(size, per_step, seed, steps):
    shared = PromptCursor(size, seed, per_step)
    for step in steps:  # any order, one cursor with a cache vs a fresh one each time
        assert shared.indices(step) == PromptCursor(size, seed, per_step).indices(step)


@PROPERTY
@given(st.integers(1, 13), st.integers(0, 2**63 - 1), st.integers(0, 4))
def test_cursor_each_epoch_is_a_permutation(size, seed, epoch):
    cursor = PromptCursor(size, seed, per_step=1)
    order = [cursor.indices(step)[0] for step in range(epoch * size, (epoch + 1) * size)]
    assert sorted(order) == list(range(size))


def test_cursor_seeds_give_different_orders():
    orders = {tuple(PromptCursor(50, seed, per_step=50).indices(0)) for seed in range(5)}
    assert len(orders) == 5


def test_cursor_epochs_differ():
    cursor = PromptCursor(50, 0, per_step=50)
    assert cursor.indices(0) != cursor.indices(1)


def test_cursor_without_shuffle_is_sequential():
    cursor = PromptCursor(5, 123, per_step=3, shuffle=False)
    assert [cursor.indices(step) for step in range(4)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]


# ---------------------------------------------------------------- recording layout


def _sample(index, prompt_ids, response_ids):
    prompt = Prompt(index, ({"role": "user", "content": f"q{index}"},), "label")
    return Sample(
        group_index=0,
        index=index,
        prompt=prompt,
        prompt_ids=tuple(prompt_ids),
        response_ids=tuple(response_ids),
        response="r",
        rollout_log_probs=tuple(-0.25 * (k + 1) for k in range(len(response_ids))),
        loss_mask=tuple(1 for _ in response_ids),
        finish_reason="stop",
        seed=index,
        engine_id="e0",
        weight_version=0,
    )


def test_flatten_padded_unpad_round_trip():
    samples = [_sample(0, [5, 6, 7], [8, 9]), _sample(1, [5], [3, 4, 2, 1]), _sample(2, [5, 6], [])]
    flat = flatten(samples)
    assert flat["offsets"].tolist() == [0, 5, 10, 12]
    assert flat["prompt_lengths"].tolist() == [3, 1, 2]
    assert flat["tokens"].tolist() == [t for s in samples for t in s.tokens]
    assert flat["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0]
    assert flat["rollout_logprobs"][:5].tolist() == [0.0, 0.0, 0.0, -0.25, -0.5]
    width = 6
    for key in ("tokens", "loss_mask", "rollout_logprobs"):
        rows = recording.padded(flat[key], flat["offsets"], width, fill=-1)
        assert rows.shape == (3, width) and rows.dtype == flat[key].dtype
        assert torch.equal(recording.unpad(rows, flat["offsets"]), flat[key])
    rows = recording.padded(flat["tokens"], flat["offsets"], width, fill=-1)
    assert rows[2].tolist() == [5, 6, -1, -1, -1, -1]
    assert [tuple(rows[i, : len(s.tokens)].tolist()) for i, s in enumerate(samples)] == [s.tokens for s in samples]


# ---------------------------------------------------------------- weights_digest


def _weights():
    gen = torch.Generator().manual_seed(3)
    return {
        "b.weight": torch.randn(3, 4, generator=gen),
        "a.bias": torch.randn(4, generator=gen),
        "c.scale": torch.randn(2, 2, generator=gen),
    }


def test_weights_digest_ignores_insertion_order():
    weights = _weights()
    assert weights_digest(weights) == weights_digest(dict(reversed(list(weights.items()))))


def test_weights_digest_sees_one_ulp():
    weights = _weights()
    bumped = {k: v.clone() for k, v in weights.items()}
    bumped["a.bias"][2] = torch.nextafter(bumped["a.bias"][2], torch.tensor(float("inf")))
    assert not torch.equal(bumped["a.bias"], weights["a.bias"])
    assert weights_digest(bumped) != weights_digest(weights)


def test_weights_digest_sees_dtype():
    weights = _weights()
    recast = {**weights, "c.scale": weights["c.scale"].double()}
    assert weights_digest(recast) != weights_digest(weights)
    ints = {"x": torch.zeros(4, dtype=torch.int32)}
    assert weights_digest(ints) != weights_digest({"x": torch.zeros(4, dtype=torch.float32)})  # same bytes


def test_weights_digest_sees_shape():
    weights = _weights()
    assert weights_digest({**weights, "c.scale": weights["c.scale"].reshape(4)}) != weights_digest(weights)
