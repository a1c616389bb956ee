"""The embedded engine's weights as it holds them when they differ from the trainer's on purpose, as a real
engine's do: its own dtype (rollout.dtype, SGLang's --dtype) and fp8 weights (rollout.quantization = "fp8").

fp8 as slime's fp8 rollouts quantize the trainer's weights for SGLang (slime 624b824a:
slime/backends/megatron_utils/megatron_to_hf/processors/quantizer_fp8.py, kernels/fp8_kernel.py): the decoder
layers' attention and MLP projection matrices (q, k, v, o; gate, up, down), not the embeddings, the LM head or the
norms, each in blocks of 128 x 128 (the last blocks smaller), a block's scale its largest |w| (at least 1e-10) over
448 (float8_e4m3fn's largest), its values w * (1 / scale) clamped to +-448 and rounded to float8_e4m3fn. An engine
with fp8 matmuls multiplies those; here, where the hardware has none, the engine holds them dequantized (q * scale,
then cast to its dtype) and multiplies in its dtype: the same weights' values, not the same kernels.

`held_form` is what the engine holds after loading a trainer export; the sync's weight check holds the engine to it
(core/weight_check.py), and `check logprobs --attribute` rebuilds the engine's weights with it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

FP8_BLOCK = 128
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_EPS = 1e-10
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
_QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def fp8_blockwise(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values [M, N], float32 scales [ceil(M / block), ceil(N / block)]) of a 2-D weight."""
    rows, cols = weight.shape
    m, n = -(-rows // block), -(-cols // block)
    padded = torch.zeros(m * block, n * block, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(m, block, n, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=FP8_EPS) / FP8_MAX
    inverse = 1.0 / scale
    values = (blocks * inverse[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(m * block, n * block)[:rows, :cols].contiguous(), scale


def fp8_dequantized(weight: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """The weight after fp8 block-wise quantization and back, in float32."""
    values, scale = fp8_blockwise(weight, block)
    rows, cols = weight.shape
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return values.float() * full


def quantized(name: str, quantization: str) -> bool:
    """Whether the engine holds tensor `name` quantized."""
    return quantization == "fp8" and _QUANTIZED.fullmatch(name) is not None


def held_form(
    weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None, quantization: str
) -> dict[str, torch.Tensor]:
    """The engine's copy of a trainer export: each tensor quantized where `quantization` says, cast to `dtype` (None:
    each its own)."""
    out = {}
    for name, tensor in weights.items():
        value = fp8_dequantized(tensor) if quantized(name, quantization) else tensor
        out[name] = value.to(dtype or tensor.dtype)
    return out


@dataclass(frozen=True)
class Numerics:
    """Where the embedded engine's numbers differ from the trainer's on purpose: its dtype (None: the model's),
    its weights' quantization, and the log-prob it reports ("full" or "filtered": sampling.renormalised)."""

    dtype: torch.dtype | None = None
    quantization: str = "none"
    logprobs: str = "full"

    def held(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the engine holds after loading `weights` (the weights themselves unless cast or quantized)."""
        if self.dtype is None and self.quantization == "none":
            return dict(weights)
        return held_form(weights, self.dtype, self.quantization)
