"""slime's `--offload-rollout` for the embedded engine (`rollout.offload`): between rollouts the engine lets go of its
GPU memory, so the trainer's stages (log-probs, training) have it. slime releases SGLang's weights and KV cache
while Megatron trains (torch_memory_saver); here the engine's weights move to host memory and its captured decode
graphs (each with its KV cache) and kept prompt prefills are dropped. Its next use (the sync's new weights, a
checksum, a rollout) brings the weights back first. Moving a tensor keeps its bytes and the graphs are captured
again from the same kernels, so a run computes the same bits with it as without.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from rlbench.backends.hf_engine import HFEngine
from rlbench.core.types import GenerateRequest, GenerateResult


class OffloadedEngine:
    """An HFEngine that lets go of its GPU memory after each `generate` (see the module). Everything else is the
    engine's own (attributes are read through)."""

    def __init__(self, engine: HFEngine):
        self.engine = engine
        self.away = False  # the weights are in host memory
        self.host: dict[str, torch.Tensor] = {}  # each parameter's pinned host copy, kept from one release to the next

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        self.back()
        try:
            return self.engine.generate(requests)
        finally:
            self.release()

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.back()
        self.engine.update_weights(weights, version)

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        self.back()
        return self.engine.weight_checksums()

    def export_weights(self, holder: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        self.back()
        return self.engine.export_weights(holder, names)

    def close(self) -> None:
        self.engine.close()

    def release(self) -> None:
        """Drop the captured graphs and kept prefills; on a GPU, move the parameters to pinned host buffers (made
        once; the module's small buffers, such as the rotary tables, stay)."""
        engine = self.engine
        engine.graphs.clear()
        engine.forget_prompts()
        if torch.device(engine.device).type == "cpu" or self.away:
            return
        for name, param in engine.model.named_parameters():
            if name not in self.host:
                self.host[name] = torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
            self.host[name].copy_(param.data)  # waits: the device copy is freed next
            param.data = self.host[name]
        self.away = True

    def back(self) -> None:
        """The weights back on the engine's device (nothing to do unless released): copied from the pinned buffers
        in stream order, before any kernel that reads them."""
        if self.away:
            for param in self.engine.model.parameters():
                param.data = param.data.to(self.engine.device, non_blocking=True)
            self.away = False
