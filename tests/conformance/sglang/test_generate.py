"""/generate and the information endpoints, as SGLang's own tests hold them.

Sources (SGLang 0.5.23: its wheel's sglang/test/test_utils.py and sglang/test/kits/, and the repository's
tests read against the 0.5.23 server code): test/registered/core/test_srt_endpoint.py @05f70dc5,
test/registered/scheduler/test_abort.py @01eebcfb (its TestAbortAll rid checks), test/manual/
test_weight_version.py @134db069, test/registered/.../test_skip_tokenizer_init.py (its run_decode and
stream checks), kits/basic_api_contract_kit.py and kits/matched_stop_kit.py (0.5.23).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.helpers import wait_running

# One xdist worker runs the whole module (--dist loadgroup): one server for it, not one per worker.
pytestmark = pytest.mark.xdist_group("sglang-conformance-generate")


PROMPT = "The capital of France is"


def _meta(answer: dict) -> dict:
    return answer["meta_info"]


def test_health_and_health_generate(server):
    """kits/basic_api_contract_kit.py (0.5.23) test_health, test_health_generate: both 200."""
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200


def test_get_server_info(server):
    """kits/basic_api_contract_kit.py (0.5.23) test_get_server_info: a non-empty object at /get_server_info;
    test_srt_endpoint.py test_get_server_info: max_total_num_tokens an int, version a string; and the
    scheduler's fields SGLang 0.5.23 adds (scheduler.get_init_info): status "ready", max_req_input_len."""
    old = server.get("/get_server_info")
    assert old.status_code == 200 and isinstance(old.json(), dict) and len(old.json()) > 0
    info = server.get("/server_info").json()
    assert isinstance(info["max_total_num_tokens"], int) and isinstance(info["version"], str)
    assert info["status"] == "ready" and isinstance(info["max_req_input_len"], int)
    if server.local is not None:  # the port it listens on, not the 0 it was started with
        assert info["port"] == int(server.url.rsplit(":", 1)[1])


def test_get_server_info_concurrent(server):
    """test_srt_endpoint.py test_get_server_info_concurrent: concurrent /server_info calls all answer."""
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: server.get("/server_info"), range(4)))
    assert all(a.status_code == 200 and isinstance(a.json(), dict) for a in answers)


def test_get_model_info(server):
    """kits/basic_api_contract_kit.py (0.5.23) test_get_model_info: model_path present and non-empty."""
    for path in ("/get_model_info", "/model_info"):
        info = server.get(path).json()
        assert "model_path" in info and info["model_path"]


def test_logprob_start_len(server):
    """test_srt_endpoint.py test_logprob_start_len: a text batch of two prompts, logprob_start_len 4, 4 new
    greedy tokens, top 5 with text: prompt_tokens = start + len(input_token_logprobs); the prompt ends with
    the texts of those entries; completion_tokens and output_token_logprobs have the 4 tokens; text is the
    output entries' texts joined. And the layout: each input entry [logprob, id, text], the first logprob
    null (tokenizer_manager / logprob_result_processor, 0.5.23)."""
    start, new = 4, 4
    prompts = ["I have a very good idea on", "Today is a sunndy day and"]
    answers = server.generate(
        {
            "text": prompts,
            "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 5,
            "return_text_in_logprobs": True,
            "logprob_start_len": start,
        }
    )
    for prompt, answer in zip(prompts, answers):
        meta = _meta(answer)
        assert meta["prompt_tokens"] == start + len(meta["input_token_logprobs"])
        assert prompt.endswith("".join(x[-1] for x in meta["input_token_logprobs"]))
        assert meta["input_token_logprobs"][0][0] is None and all(x[0] <= 0 for x in meta["input_token_logprobs"][1:])
        assert meta["completion_tokens"] == new and len(meta["output_token_logprobs"]) == new
        assert answer["text"] == "".join(x[-1] for x in meta["output_token_logprobs"])


def test_logprob_with_long_prompt(server):
    """test_srt_endpoint.py test_logprob_with_chunked_prefill (a prompt the tiny model's context takes):
    completion_tokens 4, 4 output log-probs and 4 top lists of 5, the top-1 entry equal to the sampled one
    (greedy)."""
    new = 4
    answer = server.generate(
        {
            "text": "I have a very good idea on this. " * 4,
            "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": 5,
        }
    )
    meta = _meta(answer)
    assert meta["completion_tokens"] == new
    assert len(meta["output_token_logprobs"]) == new and len(meta["output_top_logprobs"]) == new
    for i in range(new):
        assert meta["output_token_logprobs"][i] == meta["output_top_logprobs"][i][0]
        assert len(meta["output_top_logprobs"][i]) == 5


def test_logprob_match(server):
    """test_srt_endpoint.py test_logprob_match: the output log-probs of a sampled continuation are close
    (max gap < 0.35) to its input log-probs when the prompt + continuation is scored again
    (max_new_tokens 0, logprob_start_len 0)."""

    def run(prompt, max_new_tokens, start=-1):
        body = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
        return server.generate(
            {
                **body,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": start,
            }
        )

    gen = run("I have a very good idea on how to", 32, 0)
    output = np.array([x[0] for x in _meta(gen)["output_token_logprobs"]])
    prompt_len = _meta(gen)["prompt_tokens"]
    tokens = [x[1] for x in _meta(gen)["input_token_logprobs"]] + [x[1] for x in _meta(gen)["output_token_logprobs"]]
    score = run(tokens, 0, 0)
    scored = np.array([x[0] for x in _meta(score)["input_token_logprobs"][prompt_len:]])
    assert _meta(score)["completion_tokens"] == 0 and len(scored) == len(output) == 32
    assert np.max(np.abs(output - scored)) < 0.35


@pytest.mark.parametrize(
    "input_len, output_len, start, return_logprob, top",
    [(40, 4, 0, True, 0), (40, 8, 10, True, 3), (60, 4, 30, True, 3), (40, 4, 0, False, 3), (60, 8, 59, True, 0)],
)
def test_run_logprob_check(server, input_len, output_len, start, return_logprob, top):
    """sglang/test/test_utils.py run_logprob_check (0.5.23; test_srt_endpoint.py test_logprob_mixed runs it
    over a grid, here a small one): prompt_tokens and completion_tokens as asked; with return_logprob,
    len(input_token_logprobs) + logprob_start_len = prompt_tokens and one output entry per token; with
    top_logprobs_num, as many input top lists, one output top list of top_logprobs_num per token, and at
    temperature 0 the sampled entry is the top one (or tied with it)."""
    res = server.generate(
        {
            "input_ids": list(range(input_len)),
            "sampling_params": {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True},
            "return_logprob": return_logprob,
            "logprob_start_len": start,
            "top_logprobs_num": top,
        }
    )
    meta = _meta(res)
    assert meta["prompt_tokens"] == input_len and meta["completion_tokens"] == output_len
    if not return_logprob:
        assert "output_token_logprobs" not in meta
        return
    assert len(meta["input_token_logprobs"]) + start == meta["prompt_tokens"]
    assert len(meta["output_token_logprobs"]) == output_len
    if top:
        assert len(meta["input_top_logprobs"]) + start == meta["prompt_tokens"]
        assert len(meta["output_top_logprobs"]) == output_len
        for i in range(output_len):
            ranked = meta["output_top_logprobs"][i]
            assert len(ranked) == top
            rank = 0
            while ranked[rank] != meta["output_token_logprobs"][i]:
                assert ranked[rank][0] == ranked[rank + 1][0]  # a tie: the next one may be it
                rank += 1


def test_duplicate_rids(server):
    """test_abort.py TestAbortAll: the same rid twice in a row is fine (200, no error); a rid given to two
    concurrent requests gets one of them a 400 naming "Duplicate request ID"; a batch with a repeated rid is
    a 400 saying so; the server is healthy afterwards and answers a new rid with text."""

    def generate(rid, max_new_tokens=8):
        return server.post(
            "/generate",
            {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}, "rid": rid},
        )

    for _ in range(2):
        response = generate("dup-rid-test-sequential")
        assert response.status_code == 200 and "error" not in response.json()
    results = {}
    first = threading.Thread(target=lambda: results.update(first=generate("dup-rid-concurrent", 200)))
    first.start()
    wait_running(server)  # the first is in (an event, not a pause): the second, same rid, arrives while it runs
    results["second"] = generate("dup-rid-concurrent")
    first.join(30)
    rejected = [r for r in results.values() if r.status_code == 400]
    assert len(rejected) == 1 and "Duplicate request ID" in rejected[0].json()["error"]["message"]
    batch = server.post(
        "/generate",
        {
            "text": ["Hello", "World"],
            "sampling_params": {"max_new_tokens": 8},
            "rid": ["dup-rid-batch", "dup-rid-batch"],
        },
    )
    assert batch.status_code == 400 and "Duplicate request ID" in batch.json()["error"]["message"]
    assert server.get("/health").status_code == 200
    after = generate("after-dup-health")
    assert after.status_code == 200 and "text" in after.json()


def test_finish_reasons(server):
    """kits/matched_stop_kit.py (0.5.23) through the native API: a length finish ({"type": "length",
    "length": max_new_tokens}); a stop token ends the request with {"type": "stop", "matched": <its id>},
    the id kept in output_ids and trimmed from text; a stop string ends it with matched = the string and the
    text cut before it (detokenizer_manager.trim_matched_stop)."""
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
    free = server.generate(body)
    assert _meta(free)["finish_reason"] == {"type": "length", "length": 12}
    ids = free["output_ids"]
    token = server.generate(
        {**body, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [ids[2]]}}
    )
    cut = ids.index(ids[2]) + 1
    assert _meta(token)["finish_reason"] == {"type": "stop", "matched": ids[2]}
    assert token["output_ids"] == ids[:cut]
    word = free["text"][3:5]
    text = server.generate(
        {**body, "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "stop": word}}
    )
    assert _meta(text)["finish_reason"] == {"type": "stop", "matched": word}
    assert text["text"] == free["text"][: free["text"].find(word)]


def test_weight_version_in_answers(server):
    """test_weight_version.py test_weight_version_comprehensive, its first checks: /model_info carries the
    server's weight version, and so does every /generate answer's meta_info."""
    version = server.get("/model_info").json()["weight_version"]
    assert isinstance(version, str)
    answer = server.generate(
        {"text": "Hello, how are you?", "sampling_params": {"temperature": 0.0, "max_new_tokens": 5}}
    )
    assert _meta(answer)["weight_version"] == version


def test_parallel_sample(server):
    """test_skip_tokenizer_init.py test_parallel_sample / run_decode with n=3: a list of 3 answers, each
    with its own id, prompt_tokens the prompt's, as many output_ids as completion_tokens."""
    answers = server.generate(
        {"input_ids": [1, 2, 3, 4], "sampling_params": {"temperature": 0.5, "max_new_tokens": 6, "n": 3}}
    )
    assert isinstance(answers, list) and len(answers) == 3 and len({_meta(a)["id"] for a in answers}) == 3
    for answer in answers:
        assert _meta(answer)["prompt_tokens"] == 4
        assert len(answer["output_ids"]) == _meta(answer)["completion_tokens"]


def test_stream(server):
    """test_srt_endpoint.py run_decode(stream=True) and test_skip_tokenizer_init.py run_decode_stream: the
    stream is `data: {json}` events ending with `data: [DONE]`; its last chunk holds the output of the same
    request sent without streaming (chunks are cumulative in SGLang's default mode)."""
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
        "return_logprob": True,
    }
    whole = server.generate(body)
    response = server.post("/generate", {**body, "stream": True}, stream=True)
    lines = [line for line in response.iter_lines() if line]
    assert response.headers["content-type"].startswith("text/event-stream") and lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    # how many chunks depends on when the streamer wakes (a late one finds every token there): not on the answer
    assert all(line.startswith(b"data: ") for line in lines) and len(chunks) >= 1
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert [x[1] for x in _meta(chunks[-1])["output_token_logprobs"]] == whole["output_ids"]
    assert all(_meta(c)["finish_reason"] is None for c in chunks[:-1])
    assert _meta(chunks[-1])["finish_reason"] == {"type": "length", "length": 8}
    # sampling_params.stream_interval (SamplingParams, 0.5.23): at least that many new tokens a chunk, and the last
    body["sampling_params"]["stream_interval"] = 3
    response = server.post("/generate", {**body, "stream": True}, stream=True)
    sizes = [len(json.loads(line[6:])["output_ids"]) for line in response.iter_lines() if line.startswith(b"data: {")]
    assert sizes[-1] == 8 and all(b - a >= 3 for a, b in zip([0] + sizes[:-2], sizes[:-1]))


def test_logit_bias(server):
    """test_srt_endpoint.py test_logit_bias: a bias of +100 on one token (its id a string key) at temperature
    1 makes every sampled token that one."""
    target = 60
    answer = server.generate(
        {
            "text": PROMPT,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 4, "logit_bias": {str(target): 100.0}},
            "return_logprob": True,
        }
    )
    assert [x[1] for x in _meta(answer)["output_token_logprobs"]] == [target] * 4


def test_forbidden_token(server):
    """test_srt_endpoint.py test_forbidden_token: a bias of -100 on a token keeps it out of 50 sampled tokens
    (here the token the unbiased answer samples most, so the bias is what keeps it out)."""
    body = {
        "text": PROMPT,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 50, "ignore_eos": True, "sampling_seed": 3},
        "return_logprob": True,
    }
    free = [x[1] for x in _meta(server.generate(body))["output_token_logprobs"]]
    forbidden = max(set(free), key=free.count)
    body["sampling_params"]["logit_bias"] = {str(forbidden): -100.0}
    biased = [x[1] for x in _meta(server.generate(body))["output_token_logprobs"]]
    assert forbidden in free and forbidden not in biased and len(biased) == 50


def test_logit_bias_isolation(server):
    """test_srt_endpoint.py test_logit_bias_isolation, its two requests as one batch (one engine batch): the
    biased one samples only its token, the other does not; and (rlbench's batch invariance) the other's
    tokens and log-probs are those it gets alone."""
    target = 60
    plain = {"temperature": 1.0, "max_new_tokens": 4, "sampling_seed": 11}
    both = server.generate(
        {
            "text": [PROMPT, PROMPT],
            "sampling_params": [{**plain, "logit_bias": {str(target): 100.0}}, plain],
            "return_logprob": True,
        }
    )
    alone = server.generate({"text": PROMPT, "sampling_params": plain, "return_logprob": True})
    assert [x[1] for x in _meta(both[0])["output_token_logprobs"]] == [target] * 4
    assert any(x[1] != target for x in _meta(both[1])["output_token_logprobs"])
    assert _meta(both[1])["output_token_logprobs"] == _meta(alone)["output_token_logprobs"]


def test_logprob_token_ids(server):
    """test_srt_endpoint.py test_logprob_token_ids_chunked (a prompt the tiny model's context takes): one
    input_token_ids_logprobs entry per input_token_logprobs entry (None first), and where the probed id is
    the prompt's next token its log-prob is that token's; one output_token_ids_logprobs entry per new token,
    the sampled id's equal to its output log-prob (logits_processor / sampler, 0.5.23)."""
    prompt, probes = list(range(5, 205)), list(range(5, 205, 37))
    meta = _meta(
        server.generate(
            {
                "input_ids": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
                "return_logprob": True,
                "logprob_start_len": 0,
                "token_ids_logprob": probes,
            }
        )
    )
    assert len(meta["input_token_ids_logprobs"]) == len(meta["input_token_logprobs"])
    checked = 0
    for (logprob, token_id, *_), probed in zip(meta["input_token_logprobs"], meta["input_token_ids_logprobs"]):
        if logprob is None or token_id not in probes:
            continue
        assert {tid: lp for lp, tid, *_ in probed}[token_id] == pytest.approx(logprob, abs=1e-4)
        checked += 1
    assert checked > 4
    assert len(meta["output_token_ids_logprobs"]) == 4
    for (logprob, token_id, _), probed in zip(meta["output_token_logprobs"], meta["output_token_ids_logprobs"]):
        assert [tid for _, tid, _ in probed] == probes
        if token_id in probes:
            assert {tid: lp for lp, tid, _ in probed}[token_id] == logprob


def test_cache_tokens(server):
    """test_srt_endpoint.py test_cache_tokens, the steps an exact-bits cache can take (docs/sglang-ray.md):
    after /flush_cache a prompt computes every token (0); sent again, all but its last are reused (SGLang's
    count: 99 of 100), and /flush_cache empties it again. A prompt that only shares a prefix with a kept one
    is computed whole (SGLang would reuse the prefix): 0."""

    def cached(ids):
        return _meta(server.generate({"input_ids": list(ids), "sampling_params": {"max_new_tokens": 1}}))[
            "cached_tokens"
        ]

    for _ in range(2):
        assert server.post("/flush_cache").status_code == 200
    assert cached(range(0, 100)) == 0
    assert cached(range(0, 100)) == 99
    assert cached(range(0, 120)) == 0
    assert cached(range(0, 120)) == 119
    assert server.post("/flush_cache").status_code == 200
    assert cached(range(0, 100)) == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_reused_prompt_gives_the_same_bits(server, temperature):
    """rlbench's own (issue 33): the samples of a prompt, sent as separate requests (as slime sends a group),
    reuse its prefill (cached_tokens prompt_tokens - 1, SGLang's count), and every sample's tokens and
    log-probs are those of the same request on an emptied cache; n copies in one request reuse it too."""
    prompt = list(range(30, 75))

    def sample(seed):
        answer = server.generate(
            {
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {
                    "temperature": temperature,
                    "max_new_tokens": 6,
                    "ignore_eos": True,
                    "sampling_seed": seed,
                },
            }
        )
        return _meta(answer)["output_token_logprobs"], _meta(answer)["cached_tokens"]

    fresh = []
    for seed in range(3):
        assert server.post("/flush_cache").status_code == 200
        fresh.append(sample(seed))
    reused = [sample(seed) for seed in range(3)]
    assert [c for _, c in fresh] == [0, 0, 0] and [c for _, c in reused] == [len(prompt) - 1] * 3
    assert [x for x, _ in reused] == [x for x, _ in fresh]
    copies = server.generate(
        {
            "input_ids": prompt,
            "sampling_params": {"temperature": temperature, "n": 3, "max_new_tokens": 6, "ignore_eos": True},
        }
    )
    assert sorted(_meta(c)["cached_tokens"] for c in copies) == [len(prompt) - 1] * 3


def test_incremental_streaming_output(server):
    """SGLang 0.5.23's --incremental-streaming-output (tokenizer_manager._handle_batch_output): each chunk
    carries only the new output ids, text and output log-probs; concatenated they are the answer sent
    without streaming (test_skip_tokenizer_init.py run_decode_stream's check, here with text too)."""
    from dataclasses import replace

    server.needs_local("it switches the local server's --incremental-streaming-output")
    body = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True, "stream_interval": 2},
        "return_logprob": True,
    }
    whole = server.generate(body)
    state = server.local.state
    config = state.config
    state.config = replace(config, incremental_streaming_output=True)
    try:
        response = server.post("/generate", {**body, "stream": True}, stream=True)
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith(b"data: {")]
    finally:
        state.config = config
    # A chunk goes out once stream_interval new tokens are there: a streamer that wakes late (a busy machine) finds
    # more and sends them together, so the count of chunks depends on timing; what they carry does not.
    sizes = [len(c["output_ids"]) for c in chunks]
    assert 1 <= len(chunks) <= 5 and all(size >= 2 for size in sizes[:-1]) and sizes[-1] >= 1, sizes
    assert [i for c in chunks for i in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [x for c in chunks for x in _meta(c)["output_token_logprobs"]] == _meta(whole)["output_token_logprobs"]
    assert _meta(chunks[-1])["completion_tokens"] == 9 and _meta(chunks[-1])["finish_reason"]["type"] == "length"
