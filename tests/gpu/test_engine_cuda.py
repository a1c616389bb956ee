"""The batched engine on a GPU in deterministic mode: a request's bits do not depend on its batch
(fixed requests, several compositions and rows), and the batched path agrees with the per-sample
path to rounding. The CPU suite holds the same property under hypothesis."""

from __future__ import annotations

import random

from rlbench.backends.hf_engine import HFEngine
from rlbench.config import load_config
from rlbench.core.context import _encode_prompts
from rlbench.core.data import load_dataset
from rlbench.core.model import build_model, load_tokenizer
from rlbench.core.seeding import configure_determinism
from rlbench.core.types import GenerateRequest


def _setup():
    config = load_config(device="cuda")
    configure_determinism(config.threads, config.device)
    tokenizer = load_tokenizer(config.model.tokenizer)
    prompts = list(_encode_prompts(tokenizer, load_dataset(config.data.path)[:12]).values())
    model = build_model(config.model.path, master_seed=5, device="cuda", init="random")
    eos = tokenizer.eos_token_id
    requests = [GenerateRequest(prompts[i % 12], 100 + i, 4, [1.0, 0.7, 0.0][i % 3], (eos,), [-1, 5][i % 2],
                                [1.0, 0.9][i % 2]) for i in range(40)]
    return model, requests


def test_cuda_batched_decode_is_batch_invariant():
    model, requests = _setup()
    engine = HFEngine(model, device="cuda", batch_size=16)
    reference = engine.generate(requests)
    for seed in range(4):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        take = order[: 5 + 9 * seed]  # other sizes, compositions and rows
        got = engine.generate([requests[i] for i in take])
        assert [reference[i] for i in take] == got, seed
    assert engine.generate(requests[7:8])[0] == reference[7]


def test_cuda_paths_agree():
    model, requests = _setup()
    batched = HFEngine(model, device="cuda").generate(requests)
    alone = HFEngine(model, device="cuda", decode="per-sample").generate(requests)
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]
    assert max(abs(a - b) for x, y in zip(batched, alone) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4
