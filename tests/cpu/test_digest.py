"""Checksums computed where the tensor lives (rlbench/rundir/digest.py, wordsum/1): the definition, pinned by
known values and by a pure-Python reference; the numpy (CPU) and torch (device) paths equal; torch's int64
wraparound, which the device path relies on, pinned on the CPU; a single flipped bit caught in every dtype and
place; order, names, dtypes and shapes counted; old run directories and recordings refused by name; a flipped
bit in a checkpoint caught (in a recording: tests/cpu/test_corrupt_input.py). The same bytes on a GPU:
tests/gpu/test_digest_cuda.py. Speed against sha256: bench/checksum.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlbench.errors import BadInput
from rlbench.rundir import digest, digest_host, recording
from rlbench.rundir.directory import read_run
from tests.conftest import run_cli, small_toml
from tests.helpers import random_tensor

C = digest.CHUNK
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool)
OLD = "written with sha256 checksums by an older rlbench; this rlbench checksums with wordsum/1 and cannot verify them"


def _reference(data: bytes) -> tuple[int, int]:
    """The definition, one word at a time in Python integers: sum of w_i * A_k[i % C] * B_k[i // C] mod 2**64."""
    data += b"\0" * (-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    a, b = digest.a_table(), digest.b_table(len(words) // C + 1)
    return tuple(sum(w * int(a[k, i % C]) * int(b[i // C, k]) for i, w in enumerate(words)) % 2**64 for k in range(2))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _both(t: torch.Tensor) -> tuple[int, int]:
    """The lanes by both paths, held equal."""
    host, device = digest.lanes(t), digest.to_unsigned(digest.lanes(t, on_device=True))
    assert host == device, (t.dtype, tuple(t.shape))
    return host


def _flip(t: torch.Tensor, byte: int, bit: int) -> torch.Tensor:
    raw = t.clone().reshape(-1).view(torch.uint8)
    raw[byte] ^= 1 << bit
    return raw.view(t.dtype).reshape(t.shape)


# ---------------------------------------------------------------- the definition


def test_torch_int64_multiply_and_sum_wrap_modulo_2_64_on_the_cpu():
    """The device path computes in torch's int64 and relies on two's-complement wraparound; a platform where
    it does not wrap fails here, with known values (CUDA: tests/gpu/test_digest_cuda.py)."""
    assert torch.tensor([2**62 + 1]).mul(4).item() == 4
    assert torch.tensor([2**63 - 1, 2]).sum().item() == -(2**63) + 1
    big = torch.tensor([-0x61C8864680B583EB, 0x7FFFFFFFFFFFFFFF] * 1000)  # a vectorised loop and its remainder
    factor = torch.tensor([0x5851F42D4C957F2D, 3] * 1000)
    expected = sum(int(x) * int(y) for x, y in zip(big.tolist(), factor.tolist())) % 2**64
    assert (big * factor).sum().item() % 2**64 == expected == 0x4047CBDCBFFD37B0


def test_splitmix64_is_the_published_generator():
    """Output 1..3 of SplitMix64 seeded with 0 (Steele, Lea, Flood 2014; Vigna's splitmix64.c)."""
    assert digest_host.splitmix64(0, 3).tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_known_values():
    """Pinned: a change of the definition (multipliers, word order, padding, header) shows here first."""
    assert digest.a_table()[:, :2].tolist() == [
        [0x911B6C48E11C7F01, 0xBB4C4E486EEB2BF1],
        [0x98D2848E685E5BE7, 0x087026BD2686AB1F],
    ]
    assert digest.b_table(2)[:2].tolist() == [[1, 1], [0x1B9DCDB1C6F604E3, 0xE93AE20D52A2F2CB]]
    assert _both(torch.arange(10)) == (0x893C7CBFA076329D, 0xFE24330F3269409D)
    assert _both(torch.arange(11, dtype=torch.uint8)) == (0x7A8BB4F490CFD988, 0x30CACA5B6A9956F8)
    assert _both(torch.full((2 * C + 1,), -1)) == (0xC0C938019F9FDBBB, 0x3A77705B5F4C945F)
    assert (
        digest.tensors_digest({"a": torch.arange(10), "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)})
        == "c1687370fd06863b9ed3fde3d899bca93d156b11d46b900164caa113c0d78879"
    )
    assert digest.tensors_digest({}) == "cd48af365d093d1ea15a1ffd071fa56cd229430c6b33dd85c1cfc1592dfebd31"


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 8 * C - 1, 8 * C, 8 * C + 13, 16 * C + 8])
def test_both_paths_are_the_definition(nbytes):
    t = random_tensor(torch.uint8, nbytes, seed=nbytes)
    assert _both(t) == _reference(_bytes(t))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_empty_odd_sized_many_chunks_non_contiguous(dtype):
    """Both paths agree on every dtype, at sizes that leave a padded tail, span several chunks and several
    device groups; a non-contiguous or misaligned view has the checksum of its contiguous copy."""
    words = (digest.GROUP + 1) * C + 3
    for n in (0, 1, 3, 5, 1000, words * 8 // random_tensor(dtype, 1).element_size() + 1):
        _both(random_tensor(dtype, n, seed=n))
    grid = random_tensor(dtype, 33 * 64).reshape(64, 33)
    assert _both(grid.T) == _both(grid.T.contiguous()) != _both(grid)
    shifted = random_tensor(dtype, 101)[1:]  # storage offset of 1 element: not word-aligned
    assert _both(shifted) == _both(shifted.clone())
    assert _both(random_tensor(dtype, 1).reshape(())) == _both(random_tensor(dtype, 1))  # a scalar: its bytes


def test_many_tensors_reduced_together_have_each_their_own_lanes():
    """`_device_lanes_many` (how `Digests.add_all` reduces small GPU tensors in one concatenation) gives each tensor
    the lanes it has alone: empty, one byte, a padded tail, several chunks and device groups, every dtype, a
    non-contiguous view, in one batch; a flipped bit moves only its own tensor's lanes."""
    tensors = [
        random_tensor(dtype, n, seed=i)
        for i, (dtype, n) in enumerate(
            [
                (torch.uint8, 0),
                (torch.uint8, 1),
                (torch.bfloat16, 7),
                (torch.float32, (8 * C + 13) // 4),
                (torch.int64, (digest.GROUP + 2) * C + 1),
                (torch.bool, 5),
                (torch.float16, 3),
            ]
        )
    ]
    tensors.append(random_tensor(torch.float32, 64 * 33).reshape(64, 33).T)
    rows = digest._device_lanes_many([digest._byte_view(t) for t in tensors])
    assert [digest.to_unsigned(r) for r in rows] == [digest.lanes(t) for t in tensors]
    flipped = list(tensors)
    flipped[3] = _flip(tensors[3], 8 * C + 1, 5)
    again = [digest.to_unsigned(r) for r in digest._device_lanes_many([digest._byte_view(t) for t in flipped])]
    assert [i for i, (x, y) in enumerate(zip(again, rows)) if x != digest.to_unsigned(y)] == [3]


# ---------------------------------------------------------------- what a checksum catches


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_single_flipped_bit_anywhere_changes_both_lanes(dtype):
    """First, middle and last word, the padded tail, across a chunk boundary; every bit of the first word
    (bool: bit 0, the only one a bool holds)."""
    size = torch.empty((), dtype=dtype).element_size()
    n = (8 * C + 24) // size + (3 if size < 8 else 1)  # two chunks and a tail that is not a whole word
    t = random_tensor(dtype, n, seed=7)
    nbytes = n * size
    base = _both(t)
    name = digest.tensors_digest({"t": t})
    places = [0, nbytes // 2, 8 * C - 1, 8 * C, nbytes - 1]  # the last byte sits in the zero-padded last word
    bits = [0] if dtype == torch.bool else range(8)
    for byte in places:
        for bit in bits:
            flipped = _both(_flip(t, byte, bit))
            assert flipped[0] != base[0] and flipped[1] != base[1], (dtype, byte, bit)
    if dtype != torch.bool:
        for bit in range(64):  # every bit of the first whole word
            assert _both(_flip(t, bit // 8, bit % 8)) != base
    assert digest.tensors_digest({"t": _flip(t, nbytes - 1, 0)}) != name


def test_order_names_dtypes_shapes_and_lengths_count():
    a, b = torch.arange(4.0), torch.arange(4.0) + 1
    assert digest.tensors_digest([("a", a), ("b", b)]) != digest.tensors_digest([("b", b), ("a", a)])
    assert digest.tensors_digest([("x", a), ("y", b)]) != digest.tensors_digest([("x", b), ("y", a)])  # swapped
    assert digest.tensors_digest({"a": a}) != digest.tensors_digest({"b": a})
    assert digest.tensors_digest({"a": a}) != digest.tensors_digest({"a": a.view(torch.int32)})  # same bytes
    assert digest.tensors_digest({"a": a}) != digest.tensors_digest({"a": a.reshape(2, 2)})
    zeros = torch.zeros(3, dtype=torch.uint8)
    assert digest.lanes(zeros) == digest.lanes(zeros[:2])  # the padding alone: only the header tells them apart
    assert digest.tensors_digest({"z": zeros}) != digest.tensors_digest({"z": zeros[:2]})
    assert digest.tensors_digest({}) != digest.tensors_digest({"e": torch.zeros(0)})


def test_running_digests_are_the_one_shot_ones():
    """Digests (the trainer's: lanes kept until the step's end) gives what tensors_digest gives for each
    key's own sequence; weights_digests is (weights_digest, tensor_digests) from one pass."""
    grads = [{"w": torch.randn(3, 4), "b": torch.randn(4)} for _ in range(3)]
    running = digest.Digests([None, "w", "b", "never"])
    for minibatch in grads:
        for name, g in minibatch.items():
            running.add(name, g, None, name)
    out = running.hexdigests()
    assert out[None] == digest.tensors_digest([(n, g) for mb in grads for n, g in mb.items()])
    assert out["w"] == digest.tensors_digest([("w", mb["w"]) for mb in grads])
    assert out["never"] == digest.tensors_digest({})
    weights = {"z": torch.ones(2), "a": torch.zeros(3, dtype=torch.bfloat16)}
    assert digest.weights_digests(weights) == (digest.weights_digest(weights), digest.tensor_digests(weights))
    assert list(digest.tensor_digests(weights)) == ["z", "a"]


# ---------------------------------------------------------------- the run directory names its algorithm


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """4 steps, checkpoints after 0, 2 and 4 of them."""
    root = tmp_path_factory.mktemp("digest")
    (root / "s.toml").write_text(small_toml(4))
    res = run_cli("run", "-c", str(root / "s.toml"), "--out", str(root / "run"), "--json")
    assert res.returncode == 0, res.stderr
    return root / "run"


def test_run_dir_names_its_checksum_and_an_older_one_is_refused_by_name(small_run, tmp_path):
    manifest = json.loads((small_run / "manifest.json").read_text())
    assert manifest["checksum"] == digest.ALGORITHM == "wordsum/1"
    assert read_run(small_run).steps == [0, 1, 2, 3]  # accepted: its own algorithm
    tensors, _ = recording.read_step(small_run, 1)
    raw = (small_run / "rollouts" / "000001.safetensors").read_bytes()
    header = json.loads(json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]["rlbench"])
    assert header["checksum"] == "wordsum/1" and header["tensors_checksum"] == digest.tensors_digest(tensors)
    old = shutil.copytree(small_run, tmp_path / "old")
    (old / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "checksum"}))
    with pytest.raises(BadInput) as info:
        read_run(old)
    assert (
        str(info.value) == f"{old / 'manifest.json'}: checksum: {OLD}: read it with the rlbench that wrote it, "
        "or run it again"
    )
    for command in (("replay", str(old)), ("diff", str(old), str(small_run)), ("run", "--resume", str(old))):
        res = run_cli(*command)
        assert res.returncode == 2 and res.stderr.strip().splitlines() == [f"rlbench: error: {info.value}"], command
    (old / "manifest.json").write_text(json.dumps({**manifest, "checksum": "md5/9"}))
    with pytest.raises(
        BadInput,
        match=r"checksum: checksums of algorithm 'md5/9'; this rlbench reads 'wordsum/1' "
        r"only$",
    ):
        read_run(old)


def test_run_dir_refuses_an_older_recording_by_name(small_run, tmp_path):
    """A recording whose header holds sha256 (`tensors_sha256`, no `checksum`): refused, not called corrupt."""
    from safetensors.torch import save

    tensors, meta = recording.read_step(small_run, 0)
    root = tmp_path / "old"
    (root / "rollouts").mkdir(parents=True)
    old = {"schema": recording.SCHEMA, "step": 0, "tensors_sha256": "0" * 64}
    (root / "rollouts" / "000000.safetensors").write_bytes(save(tensors, metadata={"rlbench": json.dumps(old)}))
    shutil.copy(small_run / "rollouts" / "000000.json", root / "rollouts" / "000000.json")
    with pytest.raises(BadInput) as info:
        recording.read_step(root, 0)
    assert str(info.value).endswith(
        f"000000.safetensors: __metadata__: {OLD}: read it with the rlbench that wrote it, or run it again"
    )


def _flip_checkpoint(run, steps_done: int) -> None:
    """One bit in the middle of the first tensor (by name) of checkpoints/<steps_done>/model.safetensors."""
    from safetensors.torch import load_file, save_file

    path = run / "checkpoints" / f"{steps_done:06d}" / "model.safetensors"
    weights = load_file(path)
    name = sorted(weights)[0]
    weights[name] = _flip(weights[name], weights[name].numel() * weights[name].element_size() // 2, 3)
    save_file(weights, path)


@pytest.mark.parametrize("flip", [False, True])
def test_run_dir_catches_a_flipped_bit_in_a_checkpoint_on_resume(small_run, tmp_path, flip):
    """A run killed while committing step 3 (its metrics line not written): resume restarts from checkpoint
    2 and recomputes step 2, held to its recorded checksums. Intact, it resumes to the same checksums (exit
    0); one bit flipped in checkpoint 2's weights, step 2 diverges (exit 1)."""
    run = shutil.copytree(small_run, tmp_path / "run")
    metrics = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(metrics[:3]))
    if flip:
        _flip_checkpoint(run, 2)
    res = run_cli("run", "--resume", str(run), "--json")
    if not flip:
        assert res.returncode == 0, res.stderr
        assert (run / "checksums.jsonl").read_bytes() == (small_run / "checksums.jsonl").read_bytes()
    else:
        assert res.returncode == 1 and "step 2, stage " in res.stderr, res.stderr


def test_run_dir_catches_a_flipped_bit_in_checkpoint_0_in_a_train_only_run(small_run, tmp_path):
    run = shutil.copytree(small_run, tmp_path / "run")
    _flip_checkpoint(run, 0)
    res = run_cli("run", "--mode", "train-only", "--rollouts", str(run), "--out", str(tmp_path / "t"))
    assert res.returncode == 2 and "are not the recording's" in res.stderr, res.stderr


def test_the_gpu_kernel_under_tritons_interpreter():
    """The Triton kernel a GPU computes lanes with (`_fused_lanes`), run by Triton's interpreter on the CPU where
    Triton is installed (tests/gpu runs it on the device), in a process of its own (Triton reads TRITON_INTERPRET when
    it is imported, and its native library is best kept out of the suite's processes):
    tests/cpu/digest_interpreted.py's checks."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (a CPU-only install has no use for it)")
    script = Path(__file__).with_name("digest_interpreted.py")
    res = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_a_large_host_tensor_has_the_same_lanes_on_any_number_of_threads():
    """A host tensor past PARALLEL_BYTES is summed by several threads (an offloaded optimizer's gradients): the
    lanes of every split equal one thread's and torch's path's."""
    tensor = torch.randn(digest_host.PARALLEL_BYTES // 4 + 12_345, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        found = set()
        for threads in (1, 2, 3, 8):
            torch.set_num_threads(threads)
            found.add(digest.to_unsigned(digest.lanes(tensor)))
        found.add(digest.to_unsigned(digest.lanes(tensor, on_device=True)))
        many = [tensor[:n] for n in (1, 3, 8 * C + 5, 3_000_000)] + [tensor]
        sums = set()
        for threads in (1, 3):  # several host tensors in one add_all: summed together in pieces
            torch.set_num_threads(threads)
            sums.add(digest.tensors_digest([(str(i), t) for i, t in enumerate(many)]))
        torch.set_num_threads(1)
        alone = digest.Digests([None])
        for i, t in enumerate(many):
            alone.add(str(i), t, None)
        sums.add(alone.hexdigests()[None])
    finally:
        torch.set_num_threads(before)
    assert len(found) == 1 and len(sums) == 1
