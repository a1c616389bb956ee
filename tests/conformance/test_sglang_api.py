"""Conformance of rlbench's SGLang client with a server: run it against yours.

    RLBENCH_SGLANG_URL=http://HOST:PORT pytest tests/conformance

Skipped when the variable is unset. It talks to the server the way `rlbench run --rollout sglang`
does (rlbench/backends/sglang: the client, the /generate body it sends, with `ignore_eos` added so
that the server's own end-of-sequence token cannot end it early, and the answer parser that holds
every answer to its request) and checks what the run relies on: health, server and model info, one
and batched /generate with `sampling_seed` and `return_logprob`, log-probs and finish reasons in
SGLang's shape, the same tokens for the same seed, 4xx for a malformed request (the server answering
on after it), and /flush_cache. Nothing here changes the server's weights. The assertions SGLang's
own tests make of its native API are tests/conformance/sglang/.

On SGLang's own server, the same seed gives the same tokens only with
`--enable-deterministic-inference` (the seed is ignored otherwise), and the ids sent here
(1..8) must be tokens of its model. CI runs this module against `rlbench serve`
(tests/cpu/test_sglang.py imports it with the URL of a server it started).
"""

from __future__ import annotations

import math
import os

import pytest

from rlbench.backends.sglang import wire
from rlbench.backends.sglang.client import Client
from rlbench.core.types import GenerateRequest

PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)


@pytest.fixture(scope="module")
def sglang_url() -> str:
    url = os.environ.get("RLBENCH_SGLANG_URL")
    if not url:
        pytest.skip("RLBENCH_SGLANG_URL is not set: no SGLang server to check")
    return url.rstrip("/")


@pytest.fixture(scope="module")
def client():
    client = Client(max_inflight=16, timeout_s=120)
    yield client
    client.close()


def _request(seed: int = 7, max_new_tokens: int = 6, temperature: float = 1.0) -> GenerateRequest:
    return GenerateRequest(PROMPT, seed, max_new_tokens, temperature, (), -1, 1.0)


def _body(request: GenerateRequest) -> dict:
    """The run's body for `request`, with ignore_eos: the server's own end-of-sequence token (which these
    checks cannot know) must not end it before max_new_tokens."""
    body = wire.request_body(request)
    body["sampling_params"]["ignore_eos"] = True
    return body


@pytest.fixture(scope="module")
def vocab(client, sglang_url) -> int:
    """The served model's vocabulary where the server says it (rlbench serve does), else no bound."""
    info = client.run(client.ok("GET", f"{sglang_url}/server_info"))
    return int(info.get("vocab_size") or 2**31)


def _generate(client: Client, url: str, body: dict):
    return client.run(client.ok("POST", f"{url}/generate", body))


def test_health_and_health_generate(client, sglang_url):
    for path in ("/health", "/health_generate"):
        status, _ = client.run(client.call("GET", f"{sglang_url}{path}"))
        assert status == 200, path


def test_server_and_model_info(client, sglang_url):
    model = client.run(client.ok("GET", f"{sglang_url}/model_info"))
    server = client.run(client.ok("GET", f"{sglang_url}/server_info"))
    assert isinstance(model.get("model_path"), str) and model.get("is_generation") is True, model
    assert isinstance(server, dict) and "model_path" in server, server


def test_generate_answers_in_sglangs_shape(client, sglang_url, vocab):
    request = _request()
    answer = wire.parse_answer(_generate(client, sglang_url, _body(request)), sglang_url, request, vocab)
    assert len(answer.output_ids) == request.max_new_tokens and answer.finish_reason == "length"
    assert len(answer.logprobs) == len(answer.output_ids)
    assert all(math.isfinite(lp) and lp <= 0 for lp in answer.logprobs), answer.logprobs


def test_the_same_seed_gives_the_same_tokens(client, sglang_url, vocab):
    request = _request(seed=11)
    first, second = (
        wire.parse_answer(_generate(client, sglang_url, _body(request)), sglang_url, request, vocab) for _ in range(2)
    )
    assert (first.output_ids, first.logprobs) == (second.output_ids, second.logprobs)


def test_greedy_is_repeatable(client, sglang_url, vocab):
    request = _request(temperature=0.0)
    first, second = (
        wire.parse_answer(_generate(client, sglang_url, _body(request)), sglang_url, request, vocab) for _ in range(2)
    )
    assert first.output_ids == second.output_ids


def test_a_batch_answers_a_list_in_order(client, sglang_url, vocab):
    body = {
        "input_ids": [list(PROMPT), list(PROMPT[:4])],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True},
    }
    answers = _generate(client, sglang_url, body)
    assert isinstance(answers, list) and len(answers) == 2
    for item, prompt in zip(answers, body["input_ids"]):
        wire.parse_answer(item, sglang_url, GenerateRequest(tuple(prompt), 0, 3, 0.0, ()), vocab)
        assert item["meta_info"]["prompt_tokens"] == len(prompt)
    single = _generate(client, sglang_url, {**body, "input_ids": body["input_ids"][1]})
    assert single["output_ids"] == answers[1]["output_ids"]


@pytest.mark.parametrize(
    "change",
    [
        {"sampling_params": {"max_new_tokens": 2, "top_p": -1.0}},
        {"sampling_params": {"max_new_tokens": 2, "temperature": -0.5}},
        {"sampling_params": {"max_new_tokens": -3}},
        {"input_ids": []},
    ],
    ids=["top_p", "temperature", "max_new_tokens", "empty-input"],
)
def test_a_malformed_request_is_a_4xx_and_the_server_answers_on(client, sglang_url, change):
    body = {**_body(_request()), **change}
    status, data = client.run(client.call("POST", f"{sglang_url}/generate", body))
    assert 400 <= status < 500, (status, data)
    status, _ = client.run(client.call("GET", f"{sglang_url}/health_generate"))
    assert status == 200


def test_flush_cache(client, sglang_url):
    status, _ = client.run(client.call("POST", f"{sglang_url}/flush_cache"))
    assert status == 200
