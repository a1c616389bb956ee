"""The embedded rollout engine (`hf`): transformers model forward with a KV cache, in-process.

Batch invariance by construction: each request is decoded on its own (batch size 1), with its
own `torch.Generator` seeded from the request's seed, so its tokens and log-probs are the same
bytes whatever else is in the batch. Batched decoding would be faster, but padded and batched
kernels round differently per batch shape, which is exactly the drift rlbench exists to expose.
What is shared is exact: requests with the same prompt reuse one prefill (a copy of its cache).

Sampling is plain temperature sampling (temperature 0 = greedy). The log-prob reported for a
token is log_softmax(logits / temperature) at that token, as the trainer computes it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from rlbench.core.model import load_named_, named_weights
from rlbench.core.types import GenerateRequest, GenerateResult


class HFEngine:
    """Holds its own copy of the policy, as a real engine does; weights arrive through `update_weights`."""

    def __init__(self, model: torch.nn.Module, device: str = "cpu", engine_id: str = "hf:0",
                 true_on_policy: bool = False):
        self.model = copy.deepcopy(model).to(device).eval()
        self.model.requires_grad_(False)
        self.device = device
        self.true_on_policy = true_on_policy
        self.engine_id = engine_id
        self.weight_version = 0

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        from transformers import DynamicCache

        prefills: dict[tuple[int, ...], tuple[DynamicCache, torch.Tensor]] = {}
        results = []
        for req in requests:
            if req.prompt_ids not in prefills:
                cache = DynamicCache(config=self.model.config)
                ids = torch.tensor([req.prompt_ids], device=self.device)
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
                prefills = {req.prompt_ids: (out.past_key_values, out.logits[0, -1])}  # prompts come grouped
            cache, logits = prefills[req.prompt_ids]
            result = self._decode(req, copy.deepcopy(cache), logits)
            if self.true_on_policy:
                result = self._rescore(req, result)
            results.append(result)
        return results

    def _rescore(self, req: GenerateRequest, result: GenerateResult) -> GenerateResult:
        """True on-policy: log-probs from the trainer's own forward (`sequence_logprobs`) of the
        finished sequence. The tokens were still sampled from the cached decode's logits, which
        differ from these in the last bits; what trains (and is compared) is now one computation."""
        from dataclasses import replace

        from rlbench.core.algo import sequence_logprobs

        ids = torch.tensor(req.prompt_ids + result.output_ids)
        scores = sequence_logprobs(self.model, ids, req.temperature, self.device)[len(req.prompt_ids):]
        return replace(result, logprobs=tuple(float(x) for x in scores))

    def _decode(self, req: GenerateRequest, cache, logits: torch.Tensor) -> GenerateResult:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(req.seed)
        output, logprobs, finish = [], [], "length"
        for _ in range(req.max_new_tokens):
            scaled = logits.float() / req.temperature if req.temperature > 0 else logits.float()
            logp = torch.log_softmax(scaled, dim=-1)
            if req.temperature > 0:
                token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            else:
                token = int(torch.argmax(logp))
            output.append(token)
            logprobs.append(float(logp[token]))
            if token in req.stop_token_ids:
                finish = "stop"
                break
            if len(output) < req.max_new_tokens:
                step = self.model(input_ids=torch.tensor([[token]], device=self.device),
                                  past_key_values=cache, use_cache=True)
                logits = step.logits[0, -1]
        return GenerateResult(tuple(output), tuple(logprobs), finish, self.engine_id, self.weight_version)

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        load_named_(self.model, dict(weights), source=f"engine {self.engine_id} weight update")
        self.weight_version = version

    def update_weights_from_disk(self, path: Path, version: int) -> None:
        from safetensors.torch import load_file

        self.update_weights(load_file(str(path), device=self.device), version)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return named_weights(self.model)

    def close(self) -> None:
        pass
