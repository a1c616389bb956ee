"""The LM head and the log-softmax after it, chunked together (issue 57): the train and log-prob passes never hold a
micro-batch's whole [n, L, vocabulary] logits.

The model's decoder runs once over the micro-batch; its hidden states then go through the LM head a chunk of
positions at a time (algo.CHUNK_LOGITS logits at most, algo._position_chunks), and each chunk's logits go straight
into the float32 log-softmax whose picked log-probs (and entropies) are all that is kept. Under autograd a chunk is
checkpointed whole, head included: its logits and their float32 copies are recomputed in the backward, one chunk at a
time, so at Qwen3's vocabulary (151,936) a micro-batch of 16 x 300 tokens holds at most 256 MiB of float32 logits
instead of 1.4 GB of bf16 logits, their gradient and the float32 work (rlbench/core/algo.py chunked the float32 work
only; the logits were whole).

Where one chunk holds every position (the default shapes on the CPU: the fixture's vocabulary of 314), the pass is
the operations it always was: the head over every kept position, then algo's log-softmax, the same bits. Over
several chunks the forward's log-probs are the head's rows computed in several matrix products rather than one, and
the head's weight gradient a sum of per-chunk products: the same to float rounding (tests/cpu/test_chunked_logits.py
says what it holds on the CPU).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlbench.core import algo


def _hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [n, L, H]: the call a transformers CausalLM's forward makes (no cache)."""
    return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


def _entropy_graph(entropy: str) -> torch.autograd.grad_mode.set_grad_enabled:
    """Where an entropy is computed: in the graph as a loss term ("loss", when there is a graph), outside it as a
    number to report ("metric")."""
    return torch.set_grad_enabled(entropy == "loss" and torch.is_grad_enabled())


def _terms(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: str | None):
    """The picked log-probs of logits predicting targets, and their entropies where asked (_entropy_graph)."""
    picked = algo._picked_logprobs(temperature)(logits, targets)
    if entropy is None:
        return picked, None
    with _entropy_graph(entropy):
        return picked, algo._entropies(temperature)(logits)


def head_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, temperature: float, keep: int | None = None, entropy: str | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(ids[:, t] | ids[:, :t]) as [n, L] for the positions the last `keep` logits predict (None: every
    position), 0 elsewhere (position 0 always), as algo.token_logprobs of the model's logits; with `entropy`
    ("metric": no graph; "loss": in the graph), also algo.token_entropy's [n, L] entropies of the same predictions
    (None without). The logits are never whole unless one chunk holds them (the module docstring)."""
    length = ids.shape[1]
    k = keep or length
    hidden = _hidden(model, ids)[:, length - k :]
    head = model.get_output_embeddings()
    targets = ids[:, length - k + 1 :]
    chunks = algo._position_chunks(SimpleNamespace(shape=(ids.shape[0], k - 1, head.weight.shape[0])))
    if len(chunks) == 1:  # the operations of a whole pass: the head over all k positions, the last one's unused
        picked, ent = _terms(head(hidden)[:, :-1], targets, temperature, entropy)
    else:
        from torch.utils.checkpoint import checkpoint

        def chunk(hidden: torch.Tensor, targets: torch.Tensor):
            # a chunk's positions are a strided slice of every row: flattened (copied) to one matrix, the head is
            # one matrix product (a 3-D strided input goes to a batched product per row, at a third of its speed)
            rows = hidden.reshape(-1, hidden.shape[-1])
            return _terms(head(rows).view(*hidden.shape[:-1], -1), targets, temperature, entropy)

        # checkpointed with or without a graph (without one it is the plain call: nothing is saved to recompute)
        parts = [checkpoint(chunk, hidden[:, c], targets[:, c], use_reentrant=False) for c in chunks]
        picked = torch.cat([p for p, _ in parts], dim=1)
        ent = None if entropy is None else torch.cat([e for _, e in parts], dim=1)
    pad = (length - k + 1, 0)
    return torch.nn.functional.pad(picked, pad), (None if ent is None else torch.nn.functional.pad(ent, pad))


def from_logits(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, entropy: str | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """head_logprobs's answer from logits a model made whole (the last k positions of `ids`): a trainer whose model
    computes its own logits (megatron-core's GPTModel)."""
    logp = algo.token_logprobs(logits, ids, temperature)
    if entropy is None:
        return logp, None
    with _entropy_graph(entropy):
        return logp, algo.token_entropy(logits, temperature, ids.shape[1])
