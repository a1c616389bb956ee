"""Faults planted on purpose, for testing tools like `rlbench check engine` and `check logprobs --attribute`.

Batch variance (`rlbench serve --batch-variant`, `rollout.batch_invariant = false`):

A GPU's GEMM library picks its kernel by the problem's shape. A small batch gets a split-K kernel: the reduction
(here the hidden dimension) is cut into k chunks, each chunk's dot products are computed apart and the partial
sums added; another batch size gets another k. Floating-point addition is not associative, so one row's logits
come out with other bits when the batch around it changes size: the batch variance that SGLang's deterministic
mode and batch-invariant kernels remove, and that an RL run pays for as a train-inference mismatch no seed fixes.

With `HFEngine.batch_variant` on, the embedded engine's batched decode does the same: each decode forward's
lm-head product is summed over the hidden dimension in k chunks, k the number of live (non-padding) rows of the
forward, its chunk's requests. A forward of one live row takes k = 1, the lm-head's own product: the engine's
normal bits. The prefills and the per-sample path are untouched. On a GPU the decode runs eagerly (a captured
graph would keep the k of its capture).

Prefix variance (`rollout.prefix_invariant = false`): an engine that reuses a cached prefix (SGLang's radix cache, a
GRPO group's shared prompt) attends over it apart from the tokens after it and merges the two partial softmaxes by
their log-sum-exp (FlashInfer's cascade attention, SGLang's python/sglang/srt/layers/attention/merge_state.py).
SGLang's merge_state takes the prefix's and the suffix's outputs as the kernels wrote them, in the model's dtype
(bfloat16 on a GPU), with float32 log-sum-exps, and weighs each by exp(lse - max) over their sum; here each weighs
exp(lse - logaddexp(both)), the same to rounding (this is a plant, not SGLang's kernel). One softmax over the whole
sequence, as a forward over it computes, rounds its output once.
With it on, the batched decode's every step attends that way, the split at the prompt's columns (the prefill each
row reuses), the partial outputs rounded to bfloat16 whatever the model's dtype (a float32 model's rounding alone
would hide in the 1e-7 a token its batched decode already differs by): the same attention to bfloat16's rounding,
other bits than the engine's one forward over the sequence. Prefills are untouched.
"""

from __future__ import annotations

import torch

from rlbench.backends.batched_forward import EagerDecode, Engine


def split_k(hidden: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """hidden @ weight.T summed over the hidden dimension in `splits` chunks, the partial products added in order."""
    total = None
    for first in range(splits):  # chunk j: every splits-th column from column j (a kernel's interleaved split)
        partial = hidden[..., first::splits] @ weight[:, first::splits].T
        total = partial if total is None else total + partial
    return total


MERGED = "rlbench_prefix_merged"  # the prefix-variant decode's attention (registered with transformers on use)


def merged_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float,
    prefix_columns: int = 0,
    **_,
) -> tuple[torch.Tensor, None]:
    """Attention over key columns [0, prefix_columns) and the rest apart, in float32, each part's softmax-weighted
    values rounded to bfloat16 and merged by the parts' log-sum-exps (a part with no visible column weighs 0); the
    mask is boolean (True: visible)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    keys = key.repeat_interleave(heads // kv_heads, dim=1).float()  # query head h reads key head h // group
    values = value.repeat_interleave(heads // kv_heads, dim=1).float()
    scores = (query.float() @ keys.transpose(-1, -2) * scaling).masked_fill(~attention_mask, float("-inf"))
    parts = []
    for cols in (slice(0, prefix_columns), slice(prefix_columns, None)):
        part = scores[..., cols]
        top = part.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = torch.exp(part - top)
        total = weights.sum(-1, keepdim=True)
        out = (weights @ values[..., cols, :]) / total.clamp_min(torch.finfo(total.dtype).tiny)
        parts.append((out.to(torch.bfloat16).float(), top + total.log()))
    whole = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(torch.exp(lse - whole) * out for out, lse in parts)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


class SplitKDecode(EagerDecode):
    """The batched path's decode of a chunk of `live` requests, its lm-head product split `live` ways (splits 1: the
    engine's own product), and with `prefix` (the prompt's columns) its attention split and merged there."""

    def __init__(self, engine: Engine, rows: int, length: int, live: int, prefix: int | None = None):
        super().__init__(engine, rows, length)
        self.splits = max(1, min(live, engine.model.config.hidden_size))
        self.prefix = prefix
        if prefix is not None:
            from transformers import AttentionInterface

            AttentionInterface.register(MERGED, merged_attention)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, column: int) -> torch.Tensor:
        head = self.engine.model.get_output_embeddings()
        split = {} if self.prefix is None else {"attention": MERGED, "prefix_columns": self.prefix}

        def product(module, args, out):  # the lm-head's output replaced; None (k = 1) keeps its own
            if self.splits == 1:
                return None
            logits = split_k(args[0], module.weight, self.splits)
            return (logits if module.bias is None else logits + module.bias).to(out.dtype)

        hook = head.register_forward_hook(product)
        try:
            self.kv.column.fill_(column)
            return self.engine.forward_logits(tokens, positions, self.kv, mask.to(self.engine.device), **split)
        finally:
            hook.remove()
