"""The CPU compatibility layer (rlbench/backends/megatron/compat.py), one test per redirect: the
megatron-core call it serves fails (or misbehaves) on this CPU without it, and works with it. An
upgrade of megatron-core that makes a redirect unnecessary, or breaks it, fails its test here."""

from __future__ import annotations

import pytest
import torch

from rlbench.backends.megatron import compat
from rlbench.backends.megatron.model import quiet

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is for machines without CUDA")

with quiet():
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func


def test_every_redirect_has_a_test():
    names = {r.name for r in compat.REDIRECTS}
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert names <= tested, f"redirects without a test: {sorted(names - tested)}"


@pytest.fixture
def layer():
    """layer(without=name): every redirect applied except `name`; all of them applied afterwards
    (as in a process that trains on the CPU)."""

    def _set(without: str | None = None):
        compat.apply()
        if without is not None:
            compat.remove(tuple(r for r in compat.REDIRECTS if r.name == without))

    yield _set
    compat.apply()


def test_current_device(layer):
    layer(without="current_device")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
        RotaryEmbedding(16, 1.0, use_cpu_initialization=True).get_emb(8)
    layer()
    emb = RotaryEmbedding(16, 1.0, use_cpu_initialization=True).get_emb(8)
    assert emb.device.type == "cpu" and emb.shape == (8, 1, 1, 16)


def test_cuda_get_rng_state(layer):
    layer(without="cuda_get_rng_state")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
        CudaRNGStatesTracker().add("state", 1)
    layer()
    tracker = CudaRNGStatesTracker()
    tracker.add("state", 1)
    assert torch.equal(tracker.get_states()["state"], torch.random.manual_seed(1).get_state())


def test_cuda_manual_seed(layer):
    def states() -> tuple[torch.Tensor, torch.Tensor]:
        tracker = CudaRNGStatesTracker()
        tracker.add("a", 1)
        tracker.add("b", 2)
        return tracker.get_states()["a"], tracker.get_states()["b"]

    layer(without="cuda_manual_seed")  # the seed is queued for a CUDA that never starts
    a, b = states()
    assert torch.equal(a, b)
    layer()
    a, b = states()
    assert not torch.equal(a, b)


def test_tracker_get_state(layer):
    tracker = CudaRNGStatesTracker()
    layer()
    tracker.add("state", 3)
    layer(without="tracker_get_state")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
        with tracker.fork("state"):
            pass
    layer()
    with tracker.fork("state"):
        pass


def test_tracker_set_state(layer):
    def fork_takes_effect(without: str | None) -> bool:
        layer()
        tracker = CudaRNGStatesTracker()
        tracker.add("state", 3)
        forked = tracker.get_states()["state"].clone()
        torch.manual_seed(0)
        outside = torch.get_rng_state()
        layer(without=without)
        with tracker.fork("state"):
            inside = torch.get_rng_state()
        assert torch.equal(torch.get_rng_state(), outside)  # restored (or never left)
        return torch.equal(inside, forked)

    assert not fork_takes_effect(without="tracker_set_state")
    assert fork_takes_effect(without=None)


def test_causal_mask(layer):
    layer(without="causal_mask")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
        transformer_utils.get_default_causal_mask(5)
    layer()
    assert torch.equal(transformer_utils.get_default_causal_mask(5), torch.ones(5, 5).triu(1).bool())


def test_softmax_causal_mask(layer):
    softmax = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False, attention_mask_func, True, None)
    scores = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    layer(without="softmax_causal_mask")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA"):
        softmax.forward_torch_softmax(scores, None)
    layer()
    probs = softmax.forward_torch_softmax(scores, None)
    assert torch.equal(probs, torch.softmax(scores.masked_fill(torch.ones(4, 4).triu(1).bool(), -10000.0), -1))
