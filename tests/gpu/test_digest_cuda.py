"""Checksums on a GPU (rlbench/rundir/digest.py, wordsum/1): the same bytes give the same lanes and the same
checksum on the CUDA device as on the CPU, in every dtype and at sizes that span chunks and device groups; a
single flipped bit is caught there too; the Triton kernel and torch's ops agree; CUDA's int64 multiply and sum wrap
modulo 2**64 as the CPU's do (tests/cpu/test_digest.py pins them there); and only the lanes cross to the host (no
tensor is copied back)."""

from __future__ import annotations

import pytest
import torch

from rlbench.rundir import digest
from tests.helpers import random_tensor

C = digest.CHUNK
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8, torch.bool)


def _cuda_lanes(t: torch.Tensor) -> tuple[int, int]:
    on_device = digest.lanes(t.cuda())
    assert isinstance(on_device, torch.Tensor) and on_device.is_cuda
    return digest.to_unsigned(on_device.cpu())


def test_cuda_int64_multiply_and_sum_wrap_modulo_2_64():
    big = torch.tensor([-0x61C8864680B583EB, 0x7FFFFFFFFFFFFFFF] * 100_000, device="cuda")
    factor = torch.tensor([0x5851F42D4C957F2D, 3] * 100_000, device="cuda")
    expected = (big.cpu() * factor.cpu()).sum().item()
    assert (big * factor).sum().item() == expected
    assert torch.tensor([2**62 + 1], device="cuda").mul(4).item() == 4


def test_the_triton_kernel_and_torchs_ops_give_the_definitions_lanes():
    """On a GPU the lanes come from one Triton kernel (`_chunk_kernel`: each word read once, any number of tensors
    in one launch); torch's int64 ops are the path without Triton. Both equal the CPU's numpy definition, at sizes
    within a chunk, over many chunks, with a tail of fewer than 8 bytes, unaligned, and many tensors at once."""
    assert digest._chunk_kernel() is not None, "Triton is missing: GPU checksums would take torch's slower ops"
    for nbytes in (1, 8, 8 * C - 3, 8 * C, 8 * C + 5, 8 * (3 * C + 17) + 3, 8 * (digest.GROUP + 3) * C + 11):
        t = random_tensor(torch.uint8, nbytes, seed=nbytes)
        host = digest.lanes(t)
        for fused in (True, False):
            assert digest.to_unsigned(digest._device_lanes(t.cuda(), fused=fused).cpu()) == host, (nbytes, fused)
    shifted = random_tensor(torch.uint8, 8 * C + 21, seed=5).cuda()[3:]
    assert digest.to_unsigned(digest._device_lanes(shifted, fused=True).cpu()) == digest.lanes(shifted.cpu())
    # many tensors in one launch (what Digests.add_all does on a GPU), and torch's batched path beside it
    many = [
        random_tensor(torch.uint8, n, seed=n + 1) for n in (0, 3, 8, 8 * C + 5, 8 * (2 * C), 8 * (3 * C + 1) + 7, 24)
    ]
    many.append(random_tensor(torch.uint8, 8 * C + 40, seed=6)[3:])
    host = [digest.lanes(t) for t in many]
    on_gpu = [t.cuda() for t in many]
    assert [digest.to_unsigned(r) for r in digest._fused_lanes(on_gpu).cpu()] == host
    assert [digest.to_unsigned(r) for r in digest._device_lanes_many(on_gpu).cpu()] == host


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_bytes_give_the_same_checksum_on_the_gpu(dtype):
    size = torch.empty((), dtype=dtype).element_size()
    for n in (0, 1, 3, 1000, (8 * C + 13) // size, ((digest.GROUP + 2) * C * 8 + 5) // size):
        t = random_tensor(dtype, n, seed=n)
        assert _cuda_lanes(t) == digest.lanes(t), (dtype, n)
    grid = random_tensor(dtype, 64 * 33).reshape(64, 33)
    assert _cuda_lanes(grid.T) == digest.lanes(grid.T)  # non-contiguous: its row-major bytes
    shifted = random_tensor(dtype, 101)[1:]
    assert _cuda_lanes(shifted) == digest.lanes(shifted)  # not word-aligned on the device
    weights = {"w": random_tensor(dtype, 5000, seed=1).reshape(50, 100), "b": random_tensor(dtype, 7, seed=2)}
    on_gpu = {name: t.cuda() for name, t in weights.items()}
    assert digest.weights_digests(on_gpu) == digest.weights_digests(weights)
    assert digest.tensors_digest(list(on_gpu.items())) == digest.tensors_digest(list(weights.items()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_single_flipped_bit_is_caught_on_the_gpu(dtype):
    size = torch.empty((), dtype=dtype).element_size()
    t = random_tensor(dtype, (8 * C + 24) // size + 3, seed=3).cuda()
    base = digest.to_unsigned(digest.lanes(t).cpu())
    nbytes = t.numel() * size
    for byte in (0, nbytes // 2, 8 * C, nbytes - 1):
        for bit in [0] if dtype == torch.bool else range(8):
            raw = t.clone().reshape(-1).view(torch.uint8)
            raw[byte] ^= 1 << bit
            flipped = digest.to_unsigned(digest.lanes(raw.view(dtype)).cpu())
            assert flipped[0] != base[0] and flipped[1] != base[1], (dtype, byte, bit)


def test_a_trainer_step_checksums_gradients_on_the_device_as_on_the_cpu():
    """The torch trainer on the GPU keeps every minibatch's gradient lanes on the device; its grads checksum
    is the one the CPU computes from the same gradients (copied to the host here, for the test only)."""
    grads = [
        {"w": torch.randn(300, 70, device="cuda").bfloat16(), "b": torch.randn(70, device="cuda")} for _ in range(3)
    ]
    running = digest.Digests([None, "w", "b"])
    for minibatch in grads:
        for name, g in minibatch.items():
            running.add(name, g, None, name)
    out = running.hexdigests()
    assert out[None] == digest.tensors_digest([(n, g.cpu()) for mb in grads for n, g in mb.items()])
    assert out["w"] == digest.tensors_digest([("w", mb["w"].cpu()) for mb in grads])


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch-batches"])
def test_tensors_reduced_in_batches_on_the_gpu_keep_their_checksums(monkeypatch, kernel):
    """`Digests.add_all` reduces GPU tensors together: all in one launch of the Triton kernel, or without Triton in
    torch's batches of BATCH_BYTES (here made small so a step's worth of tensors spans several); every checksum
    equals the CPU's, and a flipped bit in one tensor changes that tensor's checksum and the whole's, no other."""
    monkeypatch.setattr(digest, "BATCH_BYTES", 3 * C * 8)
    if not kernel:
        monkeypatch.setattr(digest, "_use_kernel", lambda device, fused: False)
    weights = {f"layer{i}.w": random_tensor(DTYPES[i % len(DTYPES)], 1000 * i + 5, seed=i) for i in range(12)}
    weights["big"] = random_tensor(torch.float32, 4 * C * 2 + 1, seed=99)  # over BATCH_BYTES: reduced alone
    on_gpu = {name: t.cuda() for name, t in weights.items()}
    whole, each = digest.weights_digests(on_gpu)
    assert (whole, each) == digest.weights_digests(weights)
    raw = on_gpu["layer4.w"].view(torch.uint8).reshape(-1)
    raw[17] ^= 4
    whole2, each2 = digest.weights_digests(on_gpu)
    assert whole2 != whole and [n for n in each if each[n] != each2[n]] == ["layer4.w"]
