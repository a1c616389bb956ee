"""rlbench.core.tensor_file.encode writes safetensors' own bytes (held to safetensors.torch.save), in one copy."""

from __future__ import annotations

import gc
import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from rlbench.core.tensor_file import encode

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
    torch.int16,
    torch.uint16,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.uint32,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.uint64,
]


def _random_dict(generator: torch.Generator, trial: int) -> dict[str, torch.Tensor]:
    """Tensors of random dtypes, shapes (scalars and empty ones included) and bytes, under names that sort
    differently by code point and by dtype."""
    tensors = {}
    for i in range(int(torch.randint(0, 9, (1,), generator=generator))):
        dtype = DTYPES[int(torch.randint(0, len(DTYPES), (1,), generator=generator))]
        rank = int(torch.randint(0, 4, (1,), generator=generator))
        shape = [int(n) for n in torch.randint(0, 5, (rank,), generator=generator)]
        width = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, [*shape, width], dtype=torch.uint8, generator=generator)
        if dtype is torch.bool:
            raw = raw % 2
        tensor = raw.view(dtype).reshape(shape)
        tensors[f"{'zé'[i % 2]}{i}.layer/{trial}"] = tensor
    return tensors


def test_encode_is_safetensors_save_bit_for_bit():
    generator = torch.Generator().manual_seed(34)
    for trial in range(200):
        tensors = _random_dict(generator, trial)
        assert bytes(encode(tensors)) == save(tensors), trial


def test_encode_takes_any_layout_and_reads_back():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "t": base.t(),
        "strided": base[::2, 1::3],
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
    }
    data = encode(tensors)
    assert bytes(data) == save({k: v.contiguous() for k, v in tensors.items()})
    back = load(bytes(data))
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


def test_encode_metadata_sorted_and_strings_only():
    data = bytes(encode({"x": torch.ones(2)}, {"b": "1", "a": "2"}))
    (size,) = struct.unpack("<Q", data[:8])
    assert list(json.loads(data[8 : 8 + size])["__metadata__"]) == ["a", "b"]
    peer = save({"x": torch.ones(2)}, {"a": "2", "b": "1"})  # two keys: safetensors' order is a hash order
    assert json.loads(data[8 : 8 + size]) == json.loads(peer[8 : 8 + size]) and data[8 + size :] == peer[8 + size :]
    one = {"x": torch.ones(2)}
    assert bytes(encode(one, {"rlbench": "{}"})) == save(one, {"rlbench": "{}"})
    with pytest.raises(ValueError, match="strings only"):
        encode(one, {"a": 1})  # type: ignore[dict-item]


def test_encode_refuses_a_dtype_safetensors_lacks_by_name():
    with pytest.raises(ValueError, match="'c'.*complex64"):
        encode({"c": torch.zeros(2, dtype=torch.complex64)})


def test_the_buffer_outlives_its_tensors_and_is_a_copy():
    source = torch.arange(5, dtype=torch.int32)
    data = encode({"a": source})
    expected = save({"a": source.clone()})
    source += 100  # the file is a copy, made at the call
    del source
    gc.collect()
    assert bytes(data) == expected
