"""A server started with --skip-tokenizer-init, as SGLang's own test holds it.

Source: test/registered/.../test_skip_tokenizer_init.py (TestSkipTokenizerInit, read against SGLang 0.5.23:
its run_decode checks, test_parallel_sample, test_logprob, test_eos_behavior, run_decode_stream, whose
concatenated stream chunks hold for a server that streams increments: SGLang's --stream-output, in 0.5.23
--incremental-streaming-output, as this module's server is started) and the 0.5.23 tokenizer manager's
refusal of a text prompt without a tokenizer.
"""

from __future__ import annotations

import json

import pytest

# One xdist worker runs the whole module (--dist loadgroup): one server for it, not one per worker.
pytestmark = pytest.mark.xdist_group("sglang-conformance-skip_tokenizer_init")


SERVE = {"skip_tokenizer_init": True, "incremental_streaming_output": True}
INPUT_IDS = [40, 41, 42, 43, 44, 45]
EOS = 2  # the fixture model's eos_token_id


@pytest.fixture(scope="module", autouse=True)
def _tokenizerless(server):
    if not server.get("/server_info").json().get("skip_tokenizer_init"):
        pytest.skip("the server at RLBENCH_SGLANG_URL was not started with --skip-tokenizer-init")


def _decode(server, max_new_tokens=32, return_logprob=False, top_logprobs_num=0, n=1):
    return server.generate(
        {
            "input_ids": INPUT_IDS,
            "sampling_params": {
                "temperature": 0 if n == 1 else 0.5,
                "max_new_tokens": max_new_tokens,
                "n": n,
                "stop_token_ids": [EOS],
            },
            "stream": False,
            "return_logprob": return_logprob,
            "top_logprobs_num": top_logprobs_num,
            "logprob_start_len": 0,
        }
    )


def _check_item(item, max_new_tokens, return_logprob):
    """run_decode's assert_one_item: a stop matched the EOS; a length finish has max_new_tokens output ids
    (completion_tokens as many), prompt_tokens the prompt's, and with log-probs one input entry per prompt
    token (logprob_start_len 0) and one output entry per new token. No text without a tokenizer."""
    meta = item["meta_info"]
    assert "text" not in item
    if meta["finish_reason"]["type"] == "stop":
        assert meta["finish_reason"]["matched"] == EOS
    else:
        assert meta["finish_reason"]["type"] == "length"
        assert len(item["output_ids"]) == meta["completion_tokens"] == max_new_tokens
        assert meta["prompt_tokens"] == len(INPUT_IDS)
        if return_logprob:
            assert len(meta["input_token_logprobs"]) == len(INPUT_IDS)
            assert len(meta["output_token_logprobs"]) == max_new_tokens


def test_simple_decode(server):
    _check_item(_decode(server), 32, False)


def test_parallel_sample(server):
    answers = _decode(server, n=3)
    assert isinstance(answers, list) and len(answers) == 3
    for item in answers:
        _check_item(item, 32, False)


def test_logprob(server):
    for top in (0, 3):
        _check_item(_decode(server, return_logprob=True, top_logprobs_num=top), 32, True)


def test_eos_behavior(server):
    _check_item(_decode(server, max_new_tokens=200), 200, False)


@pytest.mark.parametrize("return_logprob", [False, True])
def test_simple_decode_stream(server, return_logprob):
    """run_decode_stream: the output ids of the stream's chunks, concatenated, are the answer sent without
    streaming (and so are their output log-probs, each chunk holding its own tokens')."""
    if not server.get("/server_info").json().get("incremental_streaming_output"):
        pytest.skip("the server at RLBENCH_SGLANG_URL does not stream increments (--incremental-streaming-output)")
    whole = _decode(server, return_logprob=return_logprob)
    response = server.post(
        "/generate",
        {
            "input_ids": INPUT_IDS,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "stop_token_ids": [EOS]},
            "stream": True,
            "return_logprob": return_logprob,
            "logprob_start_len": 0,
        },
        stream=True,
    )
    chunks = [
        json.loads(line[6:]) for line in response.iter_lines() if line.startswith(b"data: ") and line[6:] != b"[DONE]"
    ]
    # the chunks' count depends on when the streamer wakes; what they carry, concatenated, does not
    assert len(chunks) >= 1 and [i for c in chunks for i in c["output_ids"]] == whole["output_ids"]
    if return_logprob:
        assert [x for c in chunks for x in c["meta_info"]["output_token_logprobs"]] == whole["meta_info"][
            "output_token_logprobs"
        ]


def test_a_text_prompt_is_refused(server):
    response = server.post("/generate", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2}})
    assert response.status_code == 400
    assert "skip_tokenizer_init=True cannot accept text prompts" in response.json()["error"]["message"]
