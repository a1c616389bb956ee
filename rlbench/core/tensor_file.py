"""safetensors files made in one pass: each tensor copied once, from where it lives, into the file's own buffer.

`safetensors.torch.save` takes host tensors and builds the file's bytes from them: a real-size checkpoint is then
copied three times (device to host, host to the library's buffer, that buffer to a Python `bytes`), and at 8 GB
that was most of the 17 s a checkpoint blocked the step (bench/checkpoint.py). `encode` lays the file out first
(header and offsets) and copies every tensor straight into its slice of one host buffer, device to host where the
tensor is on a GPU; the buffer is handed out as a `memoryview`, written to disk as it is.

The bytes are safetensors' own, bit for bit (tests/cpu/test_tensor_file.py holds `encode` to
`safetensors.torch.save` across dtypes, shapes and names): tensors ordered by dtype, widest first (safetensors'
`Dtype` order, descending), then by name; the header compact JSON, padded with spaces to 8 bytes. So each
tensor's offset is a multiple of its element size, and the file reads back with safetensors' loaders.
"""

from __future__ import annotations

import json
import struct

import torch

# safetensors' Dtype enum in its declaration order (files sort by it, descending), and torch's names for each
_ORDER = (
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "F64",
    "I64",
    "U64",
)
_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
_RANK = {name: i for i, name in enumerate(_ORDER)}


def _name(tensor: torch.Tensor, key: str) -> str:
    try:
        return _DTYPES[tensor.dtype]
    except KeyError:
        raise ValueError(f"tensor {key!r}: safetensors has no dtype for {tensor.dtype}") from None


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> memoryview:
    """The safetensors file of `tensors` (on any device, any layout) as one host buffer. `metadata`, when given,
    is the header's `__metadata__` (string values, keys sorted: safetensors writes them in a hash order)."""
    order = sorted(tensors, key=lambda key: (-_RANK[_name(tensors[key], key)], key))
    header: dict[str, object] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata holds strings only")
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for key in order:
        tensor = tensors[key]
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    buffer = torch.empty(start + offset, dtype=torch.uint8)
    buffer[:start] = torch.frombuffer(bytearray(struct.pack("<Q", len(head)) + head), dtype=torch.uint8)
    with torch.no_grad():
        for key in order:
            tensor = tensors[key]
            begin, end = header[key]["data_offsets"]  # type: ignore[index]
            if end > begin:  # the slice is aligned to the element size (widest first), so it views as the dtype
                buffer[start + begin : start + end].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    return memoryview(buffer.numpy())
