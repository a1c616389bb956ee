"""Refusals in SGLang's three shapes, and `rlbench serve` under hostile input.

SGLang 0.5.23 answers a refused /generate from the layer that refuses it (srt/entrypoints/http_server.py):
FastAPI's parse of GenerateReqInput (400 {"object": "error", "message", "type": "Bad Request", "param",
"code": 400}), the API contract gate (srt/entrypoints/api_contract.py: 400 {"error": "<serde text>"}),
then the tokenizer manager's ValueErrors (400 {"error": {"message"}}, in-band under HTTP 200 for a stream).
The texts below are 0.5.23's own (api/v1/api_types.py, managers/io_struct.py, sampling/sampling_params.py,
managers/tokenizer_manager.py). What rlbench serve does not implement is refused in the third shape, by name
(docs/sglang-ray.md). The rest is rlbench's own (issue 22): no input answers 5xx, bodies are bounded, and a
slow or huge request never stalls another client.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

# One xdist worker runs the whole module (--dist loadgroup): one server for it, not one per worker.
pytestmark = pytest.mark.xdist_group("sglang-conformance-errors")


SERVE = {"max_request_bytes": 64 << 10}
ENVELOPE = {"object": "error", "type": "Bad Request", "param": None, "code": 400}


def _refused(server, body, **kwargs):
    response = server.post("/generate", body, **kwargs) if body is not None else server.post("/generate", **kwargs)
    assert response.status_code == 400, response.text
    return response.json()


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {"text": 5},
        {"input_ids": [1], "stream": None},
        {"input_ids": "abc"},
        {"input_ids": [1], "sampling_params": 5},
    ],
)
def test_the_pydantic_envelope(server, body):
    answer = _refused(server, body)
    assert {k: answer[k] for k in ENVELOPE} == ENVELOPE and isinstance(answer["message"], str)


def test_a_body_not_sent_as_json_is_not_parsed(server):
    """FastAPI (as SGLang runs it) parses the body only as application/json: text/plain is the envelope."""
    response = server.post("/generate", data=b'{"input_ids": [1, 2]}', headers={"Content-Type": "text/plain"})
    assert response.status_code == 400 and response.json()["object"] == "error"


@pytest.mark.parametrize(
    "body, text",
    [
        ({"input_ids": [1], "sampling_params": {"seed": 3}}, "unknown field `seed`, expected one of `max_new_tokens`"),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 8.0}},
            "invalid type: floating point `8.0`, expected i64",
        ),
        (
            {"input_ids": [1], "return_logprob": "yes"},
            'invalid type: string "yes", expected a value or an array of values for BoolOrList',
        ),
        ({"input_ids": [1, True]}, "invalid type: boolean `true`, expected i64"),
    ],
)
def test_the_contract_gate(server, body, text):
    answer = _refused(server, body)
    assert list(answer) == ["error"] and answer["error"].startswith(text)


@pytest.mark.parametrize(
    "body, text",
    [
        ({}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0.0."),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1, got 0."),
        (
            {"input_ids": [1], "sampling_params": {"temperature": -1}},
            "temperature must be a non-negative finite number, got -1.0.",
        ),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0, got -1."),
        (
            {"input_ids": [1], "sampling_params": {"sampling_seed": 2**63}},
            "sampling_seed must be in [-2**63, 2**63 - 1], got 9223372036854775808.",
        ),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "Duplicate request IDs detected within the request: ['x']"),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5},
            "req.logprob_start_len=5 is higher than the number of input tokens len(req.origin_input_ids)=2. "
            "Please use a "
            "smaller logprob_start_len.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**6}},
            "Requested token count exceeds the model's maximum context length",
        ),
        # SamplingParams.verify and TokenizerManager._validate_token_ids_logprob (0.5.23); the vocabulary is 314
        (
            {"input_ids": [1], "sampling_params": {"logit_bias": {"314": 1.0}}},
            "logit_bias must has keys in [0, 313], got 314.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"logit_bias": {"a": 1.0}}},
            "invalid literal for int() with base 10: 'a'",
        ),
        (
            {"input_ids": [1], "token_ids_logprob": [3, 314]},
            "token_ids_logprob contains out-of-vocabulary token id 314; valid range is [0, 314).",
        ),
        ({"input_ids": [1], "token_ids_logprob": [[3]]}, "token_ids_logprob must be a flat list of integers."),
        (
            {"input_ids": [1], "token_ids_logprob": [[3]], "sampling_params": {"n": 2}},
            "Cannot use list token_ids_logprob with parallel_sample_num > 1",
        ),
    ],
)
def test_the_value_errors(server, body, text):
    assert _refused(server, body)["error"]["message"].startswith(text)


def test_a_stream_gets_its_value_error_in_band(server):
    response = server.post("/generate", {"input_ids": [], "stream": True}, stream=True)
    lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200 and lines[-1] == b"data: [DONE]"
    assert b'"message":"input_ids cannot be empty."' in lines[0] and b'"code":400' in lines[0]


def test_what_rlbench_serve_cannot_do_is_refused_by_name(server):
    """What a CPU engine cannot run of SGLang's native API is refused by name (docs/sglang-ray.md lists it);
    logit_bias and token_ids_logprob, once refused here, are answered (test_generate.py)."""
    server.needs_local("the refusals are rlbench serve's (docs/sglang-ray.md)")
    for params in ({"frequency_penalty": 0.5}, {"min_p": 0.1}, {"regex": "a+"}, {"min_new_tokens": 2}):
        message = _refused(server, {"input_ids": [1], "sampling_params": params})["error"]["message"]
        assert message.startswith(f"rlbench serve does not implement sampling_params.{next(iter(params))}")
    for field, given in (("return_hidden_states", True), ("custom_logit_processor", "x"), ("lora_path", "a")):
        message = _refused(server, {"input_ids": [1], field: given})["error"]["message"]
        assert message.startswith(f"rlbench serve does not implement {field}")
    for body in (
        {"input_ids": [1], "sampling_params": {"logit_bias": {"5": 1.0}, "max_new_tokens": 1}},
        {"input_ids": [1], "token_ids_logprob": [3], "sampling_params": {"max_new_tokens": 1}},
    ):
        assert server.post("/generate", body).status_code == 200, body


BODY_ROUTES = {
    "/generate": {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
    "/abort_request": {"rid": "nobody"},
    "/pause_generation": {"mode": "in_place"},
    "/continue_generation": {},
    "/update_weight_version": {"new_version": "default"},
    "/weights_checker": {"action": "checksum"},
    "/get_weights_by_name": {"name": "lm_head.weight", "truncate_size": 1},
    "/update_weights_from_disk": {"model_path": "/nonexistent-rlbench-model"},
}


@pytest.mark.parametrize("path", sorted(BODY_ROUTES))
def test_a_body_with_a_byte_order_mark_is_refused(server, path):
    """SGLang 0.5.23 reads every body with orjson (http_server.ORJSONRequest), which refuses a UTF-8 byte-order
    mark: FastAPI's json_invalid at offset 0, in SGLang's 400 envelope, on every route that reads a body. The
    same body without the mark is taken (answered without a 5xx, not the envelope's json_invalid)."""
    raw = json.dumps(BODY_ROUTES[path]).encode()
    refused = server.post(path, data=b"\xef\xbb\xbf" + raw, headers={"Content-Type": "application/json"})
    answer = refused.json()
    assert refused.status_code == 400 and {k: answer[k] for k in ENVELOPE} == ENVELOPE, refused.text
    assert "'type': 'json_invalid', 'loc': ('body', 0), 'msg': 'JSON decode error'" in answer["message"]
    assert "UTF-8 byte order mark (BOM) is not supported" in answer["message"]
    taken = server.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert taken.status_code < 500 and "json_invalid" not in taken.text, taken.text
    server.post("/continue_generation", {})


def test_json_that_orjson_refuses_is_refused(server):
    """NaN and Infinity, which Python's json would take, are refused as SGLang's orjson refuses them."""
    for raw in (b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', b'{"input_ids": [1], "x": Infinity}'):
        answer = _refused(server, None, data=raw, headers={"Content-Type": "application/json"})
        assert answer["object"] == "error" and "json_invalid" in answer["message"]


def test_sglang_admits_what_it_admits(server):
    """SGLang 0.5.23 admits text with input_ids (the ids are used), a negative sampling_seed, a top_k past
    the vocabulary, and unknown top-level fields; so does rlbench serve (no 5xx either)."""
    for body in (
        {"text": "ab", "input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}},
        {"input_ids": [3], "sampling_params": {"sampling_seed": -5, "max_new_tokens": 1}},
        {"input_ids": [3], "sampling_params": {"top_k": 2**63, "max_new_tokens": 1}},
        {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}, "a_field_of_a_later_sglang": 1},
    ):
        assert server.post("/generate", body).status_code == 200, body
    assert server.get("/no_such_route").json() == {"detail": "Not Found"}


@pytest.mark.parametrize(
    "path",
    [
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/weights_checker",
        "/get_weights_by_name",
        "/flush_cache",
    ],
)
def test_a_control_route_answers_garbage_with_a_4xx(server, path):
    """rlbench's own: a body of the wrong kind on a control route is refused in SGLang's envelope (or
    answered, where SGLang admits it), never with a 5xx; the server answers on."""
    server.needs_local("some of these bodies are valid requests to a server that accepts them")
    for body in (
        None,
        [],
        5,
        "x",
        {"rid": 5, "abort_all": "x"},
        {"mode": 5},
        {"model_path": 5},
        {"new_version": 5},
        {"action": 5},
        {"name": 7, "truncate_size": "a"},
        {"timeout": "a"},
    ):
        response = server.post(path, body)
        assert response.status_code < 500, (path, body, response.text)
        if response.status_code >= 400 and response.headers["content-type"].startswith("application/json"):
            assert (
                response.json().get("object") == "error"
                or "error" in response.json()
                or response.json().get("success") is False
            ), response.text
    server.post("/continue_generation", {})
    assert server.get("/health_generate").status_code == 200


def test_a_huge_body_is_refused_before_it_is_read(server):
    """rlbench's own: a body past max_request_bytes is a 413 (SGLang's HTTPException shape), declared or
    streamed; another client is answered meanwhile."""
    server.needs_local("the limit is rlbench serve's (--max-request-bytes)")
    big = b'{"input_ids": [' + b"1," * (100 << 10) + b"1]}"
    response = server.post("/generate", data=big, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["code"] == 413

    def chunks():
        for _ in range(40):
            yield b"1," * 4096

    streamed = server.post("/generate", data=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413
    assert server.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})["output_ids"]


def test_a_slow_request_does_not_stall_others(server):
    """rlbench's own: a client that sends half a body and waits, and a long generation, hold nobody up: a
    short request is answered while both are still going (events, not a clock: the long one is seen running
    first, and when the short one is answered the long one is not done and the half body is still unanswered)."""
    from tests.helpers import wait_running

    server.needs_local("the timing is rlbench serve's")
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    slow = socket.create_connection((host, int(port)))
    try:
        slow.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"input_ids": [1,'
        )
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(
                server.post,
                "/generate",
                {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}},
            )
            wait_running(server)
            short = server.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
            assert short["meta_info"]["completion_tokens"] == 2 and not long.done()
            slow.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing answered to the half body yet: it is still going
                slow.recv(1)
            assert long.result().status_code == 200
    finally:
        slow.close()
