"""A fault planted on purpose, for testing tools like `rlbench check engine`: `rlbench serve --batch-variant`.

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


class SplitKDecode(EagerDecode):
    """The batched path's decode of a chunk of `live` requests, its lm-head product split `live` ways."""

    def __init__(self, engine: Engine, rows: int, length: int, live: int):
        super().__init__(engine, rows, length)
        self.splits = max(1, min(live, engine.model.config.hidden_size))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, column: int) -> torch.Tensor:
        head = self.engine.model.get_output_embeddings()

        def product(module, args, out):  # the lm-head's output replaced; None (k = 1) keeps its own
            if self.splits == 1:
                return None
            logits = split_k(args[0], module.weight, self.splits)
            return (logits if module.bias is None else logits + module.bias).to(out.dtype)

        hook = head.register_forward_hook(product)
        try:
            return super().forward(tokens, positions, mask, column)
        finally:
            hook.remove()
