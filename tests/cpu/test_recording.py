"""A step's recording (rlbench/rundir/recording.py) and the digests it and checksums.jsonl rest on
(rlbench/rundir/digest.py): the layout as built, a round trip, and every defect refused naming the file."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from rlbench.errors import BadInput
from rlbench.rundir import recording
from rlbench.rundir.digest import Digests, lanes, tensor_digests, tensors_digest, weights_digest


def _packed():
    return recording.pack([[5, 6], [7]], [[8, 9, 10], []], [[1, 0, 1], []], [[-0.5, -0.25, -1.0], []], [3, 3], [0, 0])


def test_pack_lays_samples_out_flat():
    t = _packed()
    assert t["tokens"].tolist() == [5, 6, 8, 9, 10, 7] and t["offsets"].tolist() == [0, 5, 6]
    assert t["prompt_lengths"].tolist() == [2, 1] and t["prompt_index"].tolist() == [3, 3]
    assert t["group_index"].tolist() == [0, 0]
    assert t["loss_mask"].tolist() == [0, 0, 1, 0, 1, 0]  # response-aligned mask, 0 on prompts
    assert t["rollout_logprobs"].tolist() == [0.0, 0.0, -0.5, -0.25, -1.0, 0.0]
    assert {k: v.dtype for k, v in t.items()} == {k: recording.DTYPES[k] for k in t}
    for empty in (recording.pack([[]], [[]], [[]], [[]], [0], [0]), recording.pack([], [], [], [], [], [])):
        assert {k: v.dtype for k, v in empty.items()} == {k: recording.DTYPES[k] for k in empty}  # empty: same dtypes
        assert empty["tokens"].numel() == 0


def test_padded_and_unpad_are_inverse():
    t = _packed()
    rows = recording.padded(t["tokens"], t["offsets"], 6, fill=-1)
    assert rows.tolist() == [[5, 6, 8, 9, 10, -1], [7, -1, -1, -1, -1, -1]] and rows.dtype == torch.int64
    assert recording.padded(t["rollout_logprobs"], t["offsets"], 5).tolist()[1] == [0.0] * 5  # fill 0 by default
    assert torch.equal(recording.unpad(rows, t["offsets"]), t["tokens"])
    empty = recording.unpad(torch.zeros(0, 4), torch.zeros(1, dtype=torch.long))
    assert empty.shape == (0,) and empty.dtype == torch.float32
    assert recording.unpad(rows[:1], t["offsets"][:2]).tolist() == [5, 6, 8, 9, 10]  # one sample


def _write(root, step=3, tensors=None, samples=None, extra=None):
    tensors = tensors if tensors is not None else {**_packed(), "rewards": torch.tensor([1.0, 0.0])}
    samples = samples if samples is not None else [{"response": "odd", "finish_reason": "stop"}, {"response": ""}]
    st, js = recording.encode_step(step, tensors, samples, extra)
    (root / "rollouts").mkdir(exist_ok=True)
    (root / "rollouts" / f"{step:06d}.safetensors").write_bytes(st)
    (root / "rollouts" / f"{step:06d}.json").write_bytes(js)
    return root / "rollouts" / f"{step:06d}.safetensors", root / "rollouts" / f"{step:06d}.json"


def test_a_step_round_trips_and_carries_its_digests(tmp_path):
    st, js = _write(tmp_path, extra={"engine": "hf"})
    tensors, meta = recording.read_step(tmp_path, 3)
    expected = {**_packed(), "rewards": torch.tensor([1.0, 0.0])}
    assert list(tensors) == sorted(expected) and all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert meta["schema"] == recording.SCHEMA and meta["step"] == 3 and meta["engine"] == "hf"
    assert meta["samples"] == [{"response": "odd", "finish_reason": "stop"}, {"response": ""}]
    assert (
        meta["samples_sha256"]
        == hashlib.sha256(  # keys sorted: the digest does not depend on their order
            b'[{"finish_reason":"stop","response":"odd"},{"response":""}]'
        ).hexdigest()
    )
    header = json.loads(st.read_bytes()[8 : 8 + int.from_bytes(st.read_bytes()[:8], "little")])["__metadata__"]
    assert list(header) == ["rlbench"]  # one key: safetensors writes several in a per-process order
    assert json.loads(header["rlbench"]) == {
        "schema": recording.SCHEMA,
        "step": 3,
        "checksum": "wordsum/1",
        "tensors_checksum": tensors_digest(dict(sorted(expected.items()))),
    }
    lines = js.read_text().splitlines()  # the bytes as written: one-space indents, one sample per line
    assert lines[:3] == ["{", ' "schema": "rlbench.run/1",', ' "step": 3,'] and lines[-1] == "}"
    assert lines[lines.index(' "samples": [') + 1 :][:3] == [
        '  {"response": "odd", "finish_reason": "stop"},',
        '  {"response": ""}',
        " ],",
    ]
    (tmp_path / "again").mkdir()
    again = _write(tmp_path / "again", extra={"engine": "hf"})
    assert [p.read_bytes() for p in again] == [st.read_bytes(), js.read_bytes()]  # the same bytes every time


MONOTONE = ": tensor 'offsets' is not a monotone split of 'tokens'$"
FIT = ": tensor 'prompt_lengths' does not fit the samples' lengths$"


def _refused(root, step=3, match=""):
    with pytest.raises(BadInput, match=match) as info:
        recording.read_step(root, step)
    return info.value


def test_missing_truncated_or_edited_files_are_refused_naming_the_file(tmp_path):
    st, js = _write(tmp_path)
    assert _refused(tmp_path, 4, "missing: the recording of committed step 4").path == str(
        st.with_name("000004.safetensors")
    )
    raw = st.read_bytes()
    st.write_bytes(raw[: len(raw) // 2])
    assert _refused(tmp_path, match="corrupt or truncated safetensors").path == str(st)
    flipped = bytearray(raw)
    flipped[-1] ^= 1  # a tensor byte
    st.write_bytes(bytes(flipped))
    assert _refused(tmp_path, match=": corrupt: tensors do not match the digest in the file's header$").path == str(st)
    st.write_bytes(raw)
    js.unlink()
    assert _refused(tmp_path, match="missing").path == str(js)


def test_a_header_that_is_not_an_object_is_refused(tmp_path):
    from safetensors.torch import save

    st, _ = _write(tmp_path)
    st.write_bytes(save({"x": torch.zeros(1)}, metadata={"rlbench": "[1, 2]"}))
    _refused(tmp_path, match=r"corrupt or truncated safetensors \(TypeError: the rlbench metadata is not an object\)")


def test_a_recording_of_another_step_or_schema_is_refused(tmp_path):
    st, js = _write(tmp_path)
    st.rename(st.with_name("000004.safetensors"))
    js.rename(js.with_name("000004.json"))
    error = _refused(tmp_path, 4, "expected schema 'rlbench.run/1' and step 4, got 'rlbench.run/1' and 3")
    assert (error.field, error.path) == ("__metadata__", str(st.with_name("000004.safetensors")))
    st, js = _write(tmp_path)
    doc = json.loads(js.read_text())
    js.write_text(json.dumps({**doc, "schema": "rlbench.run/0"}))
    assert _refused(tmp_path, match="expected 'rlbench.run/1', got 'rlbench.run/0'").field == "schema"
    js.write_text("[]")
    assert _refused(tmp_path, match="got 'list'").path == str(js)
    js.write_text(json.dumps({**doc, "samples": [{"response": "even"}, {"response": ""}]}))
    assert _refused(tmp_path, match=": corrupt: samples do not match samples_sha256$").path == str(js)
    _write(tmp_path, samples=["odd", "even"])
    error = _refused(tmp_path, match=": expected a list of per-sample objects$")
    assert (error.field, error.path) == ("samples", str(js))
    _write(tmp_path, samples=[{"response": "odd"}])
    _refused(tmp_path, match="'offsets' has 3 values, expected 2")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("rewards"), "tensor 'rewards' missing"),
        (lambda t: t.update(rewards=t["rewards"].double()), "tensor 'rewards' is torch.float64 of shape"),
        (lambda t: t.update(tokens=t["tokens"].reshape(2, 3)), "expected a flat torch.int64 tensor"),
        (lambda t: t["tokens"].__setitem__(0, -1), "tensor 'tokens' holds -1; ids and indices are >= 0"),
        (lambda t: t["group_index"].__setitem__(1, -2), "tensor 'group_index' holds -2"),
        (lambda t: t["loss_mask"].__setitem__(0, 2), "tensor 'loss_mask' holds 2; expected 0 or 1"),
        (lambda t: t.update(rewards=torch.zeros(3)), "tensor 'rewards' has 3 values, expected 2"),
        (lambda t: t.update(old_logprobs=torch.zeros(5)), "tensor 'old_logprobs' has 5 values, expected 6"),
        (lambda t: t.update(offsets=torch.tensor([1, 5, 6])), MONOTONE),
        (lambda t: t.update(offsets=torch.tensor([0, 5, 7])), MONOTONE),
        (lambda t: t.update(offsets=torch.tensor([0, 7, 6])), MONOTONE),
        (lambda t: t.update(prompt_lengths=torch.tensor([6, 1])), FIT),
        (lambda t: t.update(prompt_lengths=torch.tensor([2, 2])), FIT),  # the second sample's
        (lambda t: t.update(prompt_lengths=torch.tensor([2, -1])), FIT),
        *[
            (
                lambda t, key=key: t.update({key: torch.cat([t[key], t[key][:1]])}),
                f"tensor '{key}' has 3 values, expected 2",
            )
            for key in ("prompt_lengths", "prompt_index", "group_index")
        ],
        *[
            (
                lambda t, key=key: t.update({key: torch.zeros(7, dtype=recording.DTYPES[key])}),
                f"tensor '{key}' has 7 values, expected 6",
            )
            for key in ("loss_mask", "rollout_logprobs", "ref_logprobs")
        ],
        (lambda t: t.update(advantages=torch.zeros(1)), "tensor 'advantages' has 1 values, expected 2"),
    ],
)
def test_a_layout_defect_is_refused(tmp_path, edit, message):
    tensors = {**_packed(), "rewards": torch.tensor([1.0, 0.0])}
    edit(tensors)
    st, _ = _write(tmp_path, tensors=tensors)
    assert _refused(tmp_path, match=message).path == str(st)


def test_offsets_must_not_go_back_anywhere(tmp_path):
    tensors = {
        **recording.pack([[5], [6], [7]], [[1], [], [2]], [[1], [], [1]], [[-0.5], [], [-0.5]], [0, 1, 2], [0, 1, 2]),
        "rewards": torch.zeros(3),
    }
    _write(tmp_path, tensors=tensors, samples=[{}, {}, {}])
    recording.read_step(tmp_path, 3)
    tensors["offsets"] = torch.tensor([0, 3, 2, 5])  # the middle sample ends before it starts
    _write(tmp_path, tensors=tensors, samples=[{}, {}, {}])
    _refused(tmp_path, match=MONOTONE)


def test_edge_values_of_the_layout_are_accepted(tmp_path):
    tensors = {**_packed(), "rewards": torch.tensor([1.0, 0.0]), "old_logprobs": torch.zeros(6)}
    tensors["prompt_lengths"] = torch.tensor([5, 0])  # a sample that is all prompt, one that is all response
    tensors["tokens"][0] = 0
    _write(tmp_path, tensors=tensors)
    assert recording.read_step(tmp_path, 3)[0]["prompt_lengths"].tolist() == [5, 0]
    no_tokens = {
        **recording.pack([[5, 6], []], [[8], []], [[1], []], [[-0.5], []], [0, 1], [0, 1]),
        "rewards": torch.zeros(2),
    }  # a sample with no tokens at all: an empty span
    _write(tmp_path, tensors=no_tokens)
    assert recording.read_step(tmp_path, 3)[0]["offsets"].tolist() == [0, 3, 3]


def test_check_ids_holds_tokens_to_the_models_vocabulary(tmp_path):
    from rlbench.core.vocab import Vocab

    t = _packed()
    Vocab(11, 4).check(t, tmp_path / "x")  # max id 10 of the model's 11: valid, though the tokenizer has 4 ids
    with pytest.raises(
        BadInput,
        match=r"token id 10 is outside the model's vocabulary \(10 ids; the tokenizer has "
        r"4\)",
    ) as info:
        Vocab(10, 4).check(t, tmp_path / "x")
    assert info.value.path == str(tmp_path / "x") and info.value.field == "tokens"
    Vocab(1, 1).check({"tokens": torch.zeros(0, dtype=torch.long)}, tmp_path)


# ---------------------------------------------------------------- digests


def test_tensors_digest_is_sha256_of_name_dtype_shape_length_and_lanes():
    """The checksum string: sha256 over the algorithm's prefix and, per tensor, its header and its two lanes
    (the lanes' own definition: tests/cpu/test_digest.py)."""
    tensor = torch.tensor([[1, 2], [3, 4]], dtype=torch.int16)
    header = b'["w","torch.int16",[2,2],8]'
    first, second = lanes(tensor)
    prefix = b"rlbench checksum wordsum/1\0"
    by_hand = hashlib.sha256(
        prefix + len(header).to_bytes(4, "little") + header + first.to_bytes(8, "little") + second.to_bytes(8, "little")
    ).hexdigest()
    assert tensors_digest({"w": tensor}) == tensors_digest([("w", tensor)]) == by_hand
    assert tensors_digest({"w": tensor.t().contiguous().t()}) == by_hand  # a non-contiguous view: its values
    pair = [("a", tensor), ("b", tensor.float())]
    assert tensors_digest(pair) != tensors_digest(pair[::-1])  # in the order given
    assert weights_digest(dict(pair)) == weights_digest(dict(pair[::-1])) == tensors_digest(pair)
    assert tensors_digest({}) == hashlib.sha256(prefix).hexdigest()
    assert tensors_digest({"w": tensor.requires_grad_(False)}) != tensors_digest({"v": tensor})


def test_tensor_digests_gives_each_tensor_its_own_digest_and_digests_feeds_several():
    """What an engine reports of its weights: one digest per name, each the digest of that tensor alone."""
    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(2, dtype=torch.bfloat16)
    assert tensor_digests({"a": a, "b": b}) == {"a": tensors_digest({"a": a}), "b": tensors_digest({"b": b})}
    assert tensor_digests({"a": a})["a"] != tensor_digests({"a": a.clone().fill_(1)})["a"]
    assert tensor_digests({}) == {}
    several = Digests()
    several.add("a", a.t(), 1, 2, 3)  # a view, several running digests: each gets the same record
    assert set(several.hexdigests().values()) == {tensors_digest({"a": a.t().contiguous()})}


def test_the_step_json_is_indented_with_one_sample_per_line_and_an_empty_list_as_brackets():
    """The layout a reader of rollouts/*.json sees (json.dumps(indent=1) but for the samples, one per line)."""
    _, js = recording.encode_step(
        3, {"rewards": torch.tensor([1.0])}, [{"response": "odd", "finish_reason": "stop"}, {"response": ""}], None
    )
    digest = hashlib.sha256(b'[{"finish_reason":"stop","response":"odd"},{"response":""}]').hexdigest()
    assert js.decode() == (
        '{\n "schema": "rlbench.run/1",\n "step": 3,\n "samples": [\n'
        '  {"response": "odd", "finish_reason": "stop"},\n  {"response": ""}\n ],\n'
        f' "samples_sha256": "{digest}"\n}}\n'
    )
    _, js = recording.encode_step(3, {"rewards": torch.zeros(0)}, [], None)
    assert '\n "samples": [],\n' in js.decode() and json.loads(js)["samples"] == []


def test_a_long_safetensors_error_is_cut_at_80_characters(tmp_path):
    from safetensors import SafetensorError
    from safetensors.torch import load

    st, _ = _write(tmp_path)
    raw = b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"a": [1, 2, 3]}'  # a header that is JSON, not a safetensors one
    st.write_bytes(raw)
    with pytest.raises(SafetensorError) as original:
        load(raw)
    assert len(str(original.value)) > 80
    message = str(_refused(tmp_path, match="corrupt or truncated safetensors"))
    assert message.endswith(f"(SafetensorError: {str(original.value)[:80]})")
