"""The float32 log-softmax of the train and log-prob passes, chunked along positions (rlbench/core/algo.py
CHUNK_LOGITS, issue 34): chunked or whole, the log-probs, entropies and the gradients they send back to the
logits are the same bits, and a chunk never holds more logits than the bound."""

from __future__ import annotations

import pytest
import torch

from rlbench.core import algo


def _case(dtype):
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 9, 1000, generator=generator) * 3).to(dtype)
    tokens = torch.randint(0, 1000, (3, 12), generator=generator)
    return logits, tokens


def _forward_backward(logits, tokens):
    leaf = logits.clone().requires_grad_(True)
    logp = algo.token_logprobs(leaf, tokens, 0.7)
    entropy = algo.token_entropy(leaf, 0.7, 12)
    weights = torch.linspace(-1, 1, 12)
    ((logp * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
    return logp.detach(), entropy.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_is_whole_bit_for_bit(monkeypatch, dtype):
    logits, tokens = _case(dtype)
    whole = _forward_backward(logits, tokens)
    assert len(algo._position_chunks(logits[:, :-1])) == 1  # the default bound: one chunk at this size
    for per in (1, 2, 5):  # positions per chunk: 3 rows x 1000 logits each
        monkeypatch.setattr(algo, "CHUNK_LOGITS", 3 * 1000 * per)
        assert len(algo._position_chunks(logits[:, :-1])) == -(-8 // per)
        chunked = _forward_backward(logits, tokens)
        for a, b in zip(whole, chunked):
            assert a.dtype == b.dtype and torch.equal(a, b), per
    with torch.no_grad():
        assert torch.equal(algo.token_logprobs(logits, tokens, 0.7), whole[0])


def test_a_chunk_holds_at_most_the_bound():
    logits = torch.empty(16, 300, 151_936, dtype=torch.bfloat16, device="meta")
    chunks = algo._position_chunks(logits)
    assert max(c.stop - c.start for c in chunks) * 16 * 151_936 <= algo.CHUNK_LOGITS
    assert [c.start for c in chunks] == list(range(0, 300, chunks[0].stop)) and chunks[-1].stop == 300
    one = algo._position_chunks(torch.empty(2**20, 1, 2**10, device="meta"))  # a position over the bound: alone
    assert one == [slice(0, 1)]


# The LM head chunked with the log-softmax (rlbench/core/lm_head.py, issue 57): a micro-batch's logits are never
# whole unless one chunk holds them, in which case the pass is the operations a whole pass always was.


def _model(dtype):
    from rlbench.config import RunConfig
    from rlbench.core.model import build_model

    return build_model(RunConfig().model.path, 0, dtype, init="checkpoint")


def _head_pass(model, ids, keep, entropy):
    from rlbench.core import lm_head

    model.zero_grad(set_to_none=True)
    logp, ent = lm_head.head_logprobs(model, ids, 0.7, keep=keep, entropy=entropy)
    weights = torch.linspace(-1, 1, ids.shape[1])
    loss = (logp * weights).sum() + ((ent * weights.flip(0)).sum() if entropy == "loss" else 0)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logp.detach(), None if ent is None else ent.detach(), grads


def _whole_pass(model, ids, keep, entropy):
    """The pass as the trainer ran it before issue 57: the model's logits whole, then algo's log-softmax."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, logits_to_keep=keep or 0, use_cache=False).logits
    logp = algo.token_logprobs(logits, ids, 0.7)
    with torch.set_grad_enabled(entropy == "loss"):
        ent = algo.token_entropy(logits, 0.7, ids.shape[1])
    weights = torch.linspace(-1, 1, ids.shape[1])
    loss = (logp * weights).sum() + ((ent * weights.flip(0)).sum() if entropy == "loss" else 0)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("keep,entropy", [(None, "metric"), (12, "loss"), (12, None)])
def test_one_chunk_is_the_whole_pass_bit_for_bit(dtype, keep, entropy):
    model = _model(dtype)
    ids = torch.randint(0, 314, (3, 20), generator=torch.Generator().manual_seed(3))
    k = keep or 20
    assert len(algo._position_chunks(torch.empty(3, k - 1, 314, device="meta"))) == 1
    head, whole = _head_pass(model, ids, keep, entropy), _whole_pass(model, ids, keep, entropy)
    assert torch.equal(head[0], whole[0]) and head[0].dtype == whole[0].dtype
    assert head[1] is None if entropy is None else torch.equal(head[1], whole[1])
    assert head[2].keys() == whole[2].keys()
    for name in head[2]:
        assert torch.equal(head[2][name], whole[2][name]), name


@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("per", [1, 2, 5])
def test_several_chunks_hold_less_and_agree_to_rounding(monkeypatch, dtype, rtol, per):
    from rlbench.core import lm_head

    model = _model(dtype)
    ids = torch.randint(0, 314, (3, 20), generator=torch.Generator().manual_seed(3))
    whole = _whole_pass(model, ids, 12, "loss")
    monkeypatch.setattr(algo, "CHUNK_LOGITS", 3 * 314 * per)
    biggest = []  # the head's outputs as they are made: never more than a chunk's positions
    head_module = model.get_output_embeddings()
    hook = head_module.register_forward_hook(lambda _m, _i, out: biggest.append(out.numel() // (3 * 314)))
    made = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: made.append(k) or real(*a, **k))
    head = _head_pass(model, ids, 12, "loss")
    hook.remove()
    assert max(biggest) == per and len(made) == -(-11 // per)  # 11 predicting positions, each chunk checkpointed
    assert all(k == {"use_reentrant": False} for k in made)  # non-reentrant: the chunk's inputs need no grad
    assert torch.allclose(head[0], whole[0], rtol=rtol, atol=rtol * 1e-1)
    assert torch.allclose(head[1], whole[1], rtol=rtol, atol=rtol * 1e-1)
    for name, grad in whole[2].items():
        scale = grad.abs().max().item() or 1.0
        assert (head[2][name] - grad).abs().max().item() <= rtol * scale, name
    assert lm_head.head_logprobs(model, ids, 0.7, keep=12)[1] is None


def test_several_chunks_without_a_graph_and_the_entropy_as_a_metric(monkeypatch):
    """Without autograd the chunks give the values they give with it; an entropy asked as a metric is outside the
    graph whether the pass keeps one or not, one asked for the loss inside it."""
    from rlbench.core import lm_head

    model = _model("float32")
    ids = torch.randint(0, 314, (3, 20), generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(algo, "CHUNK_LOGITS", 3 * 314 * 4)
    with torch.no_grad():
        plain = lm_head.head_logprobs(model, ids, 0.7, keep=12, entropy="loss")
    for entropy, graph in (("metric", False), ("loss", True)):
        logp, ent = lm_head.head_logprobs(model, ids, 0.7, keep=12, entropy=entropy)
        assert torch.equal(logp.detach(), plain[0]) and torch.equal(ent.detach(), plain[1])
        assert logp.requires_grad and ent.requires_grad is graph
    assert not plain[0].requires_grad and not plain[1].requires_grad


@pytest.mark.parametrize("entropy", [None, "metric", "loss"])
def test_from_logits_is_algos_log_softmax_of_whole_logits(entropy):
    """The megatron trainer's path: algo.token_logprobs and token_entropy of the logits the model made whole."""
    from rlbench.core import lm_head

    logits, tokens = _case(torch.float32)
    leaf = logits.clone().requires_grad_(True)
    logp, ent = lm_head.from_logits(leaf, tokens, 0.7, entropy)
    assert torch.equal(logp, algo.token_logprobs(leaf, tokens, 0.7)) and logp.requires_grad
    if entropy is None:
        assert ent is None
    else:
        assert torch.equal(ent, algo.token_entropy(leaf, 0.7, 12)) and ent.shape == (3, 12)
        assert ent.requires_grad is (entropy == "loss")
