"""Abort, pause and continue, and weight updates under load, as SGLang's own tests hold them.

Sources: sglang/test/kits/abort_timeout_kit.py AbortAllMixin and kits/pause_generation_kit.py
PauseResumeInPlaceMixin (SGLang 0.5.23), test/registered/scheduler/test_abort.py @01eebcfb
(TestAbortAllWithRetraction's checks of an aborted answer), test/registered/rl/
test_update_weights_from_disk.py @02901e17 (test_update_weights_non_blocking,
TestServerUpdateWeightsFromDiskAbortAllRequests). Where they sleep a fixed time for requests to start,
these wait for /v1/loads to show them running (SGLang's endpoint too), so the tests hold on a slow machine.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import pytest

from tests.conformance.sglang.conftest import write_checkpoint
from tests.helpers import wait_running

# One xdist worker runs the whole module (--dist loadgroup): one server for it, not one per worker.
pytestmark = pytest.mark.xdist_group("sglang-conformance-control")


# Started as SGLang's tests start theirs: no --weights-dir (loopback without a key reads any path, as SGLang).
SERVE = {"weights_dir": None}
LONG = 200  # new tokens of a request that is still running when the test acts on it


def _long(server, prompt_id: int = 0, **extra):
    return server.post(
        "/generate",
        {
            "text": f"Question {prompt_id}: the capital of France is",
            "sampling_params": {
                "temperature": 0.8,
                "max_new_tokens": LONG,
                "ignore_eos": True,
                "sampling_seed": prompt_id,
            },
            **extra,
        },
    )


def test_abort_all(server):
    """AbortAllMixin.test_abort_all: requests in flight, then /abort_request {"abort_all": true} (200): every
    one of them answers with finish_reason type "abort"; the server lives on. And TestAbortAllWithRetraction's
    checks of an aborted answer with partial output: completion_tokens = its output ids, a weight_version, an
    e2e_latency above 0, one output (and top) log-prob per output id."""
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_long, server, i, return_logprob=True, top_logprobs_num=3) for i in range(6)]
        wait_running(server, in_flight=6)  # all six arrived, one at least running: abort_all reaches every one
        response = server.post("/abort_request", {"abort_all": True})
        assert response.status_code == 200
        results = [f.result().json() for f in as_completed(futures)]
    partial = 0
    for result in results:
        meta = result["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        if result["output_ids"]:
            partial += 1
            assert meta["completion_tokens"] == len(result["output_ids"]) < LONG
            assert meta["weight_version"] is not None and meta["e2e_latency"] > 0
            for key in ("output_token_logprobs", "output_top_logprobs"):
                assert len(meta[key]) == len(result["output_ids"]), key
    assert partial > 0
    assert server.get("/health").status_code == 200


def test_abort_one_request_by_rid(server):
    """/abort_request {"rid"} (http_server.abort_request, 0.5.23): the named request ends with finish type
    "abort"; another one running beside it is not touched."""
    with ThreadPoolExecutor(2) as pool:
        victim = pool.submit(_long, server, 1, rid="abort-me")
        other = pool.submit(
            server.post,
            "/generate",
            {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}},
        )
        wait_running(server, in_flight=2)  # both in: the rid aborted must be the server's already
        assert server.post("/abort_request", {"rid": "abort-me"}).status_code == 200
        assert victim.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert other.result().json()["meta_info"]["finish_reason"] == {"type": "length", "length": 40}


def test_pause_resume_in_place(server):
    """PauseResumeInPlaceMixin.test_pause_resume_in_place: with requests in flight, /pause_generation
    {"mode": "in_place"} stops them where they are: none completes while paused; after
    /continue_generation every one completes (200) with text."""
    count = 6
    with ThreadPoolExecutor(count) as pool:
        futures = {pool.submit(_long, server, i): i for i in range(count)}
        wait_running(server)
        assert server.post("/pause_generation", {"mode": "in_place"}).json() == {
            "message": "Generation paused successfully.",
            "status": "ok",
        }
        time.sleep(0.1)
        done_before = sum(1 for f in futures if f.done())
        time.sleep(0.5)
        done_after = sum(1 for f in futures if f.done())
        assert done_before < count and done_after == done_before
        assert server.post("/continue_generation", {}).json() == {
            "message": "Generation continued successfully.",
            "status": "ok",
        }
        answers = [f.result(timeout=60) for f in as_completed(futures)]
    assert all(a.status_code == 200 and len(a.json()["text"]) > 0 for a in answers)


def test_update_weights_non_blocking(server, tmp_path):
    """test_update_weights_from_disk.py test_update_weights_non_blocking: with requests in flight, pause
    (in_place, then retract), update the weights (flushing the cache only after retract), continue: the
    update succeeds, no request ends aborted, and /get_model_info names the new model. With SGLang 0.5.23's
    bookkeeping of it (utils/weight_versions.py, schedule_batch.reset_for_retract): in place, a request
    that had tokens before the update names both versions in weight_versions, the new one last and in
    weight_version; retracted, requests count it in num_retractions."""
    server.needs_local("it writes a second model directory the server reads")
    origin = server.get("/get_model_info").json()["model_path"]
    new = str(write_checkpoint(tmp_path / "new", seed=5))
    for mode in ("in_place", "retract"):
        before = server.get("/model_info").json()["weight_version"]
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(_long, server, i) for i in range(6)]
            wait_running(server)
            server.post("/pause_generation", {"mode": mode})
            answer = server.post(
                "/update_weights_from_disk",
                {"model_path": new, "flush_cache": mode == "retract", "weight_version": f"after-{mode}"},
            )
            assert answer.json()["success"] is True, answer.text
            server.post("/continue_generation", {})
            metas = [future.result().json()["meta_info"] for future in as_completed(futures)]
        assert all(meta["finish_reason"]["type"] != "abort" for meta in metas)
        assert all(meta["weight_version"] == f"after-{mode}" for meta in metas)
        if mode == "in_place":
            spans = [meta["weight_versions"] for meta in metas if len(meta["weight_versions"]) == 2]
            assert spans and all(
                s[0]["version"] == before
                and s[1]["version"] == "after-in_place"
                and s[0]["end"] == s[1]["start"]
                and s[1]["end"] == LONG
                for s in spans
            )
        else:
            assert any(meta["num_retractions"] >= 1 for meta in metas)
        moved = server.get("/get_model_info").json()["model_path"]
        assert moved == new and moved != origin
    server.post("/update_weights_from_disk", {"model_path": origin})


def test_update_weights_abort_all_requests(server, tmp_path):
    """TestServerUpdateWeightsFromDiskAbortAllRequests.test_update_weights_abort_all_requests: an update with
    abort_all_requests while requests run succeeds, every running request ends aborted, and the model path
    moves to the new model."""
    server.needs_local("it writes a second model directory the server reads")
    origin = server.get("/get_model_info").json()["model_path"]
    new = str(write_checkpoint(tmp_path / "new", seed=6))
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_long, server, i) for i in range(6)]
        wait_running(server, in_flight=6)  # all six in (running or waiting): one still on its way would not be aborted
        answer = server.post("/update_weights_from_disk", {"model_path": new, "abort_all_requests": True})
        assert answer.json()["success"] is True
        for future in as_completed(futures):
            assert future.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    moved = server.get("/get_model_info").json()["model_path"]
    assert moved == new and moved != origin
    server.post("/update_weights_from_disk", {"model_path": origin})


def test_pause_abort_then_continue(server):
    """/pause_generation's default mode, "abort" (tokenizer_manager.pause_generation, 0.5.23): running
    requests end aborted; a request sent while paused waits and is answered after /continue_generation."""
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(_long, server, 3)
        wait_running(server)
        server.post("/pause_generation", {})
        assert running.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
        waiting = pool.submit(server.post, "/generate", {"input_ids": [7], "sampling_params": {"max_new_tokens": 2}})
        time.sleep(0.2)
        assert not waiting.done()
        server.post("/continue_generation", {})
        assert waiting.result().status_code == 200


def test_update_weights_right_after_abort_all(server, tmp_path):
    """TestServerUpdateWeightsFromDiskAbortAllRequests.test_update_weights_abort_all_requests as a client that
    ends its round does it (slime's abort then update): requests with ignore_eos false in flight,
    /abort_request {"abort_all": true}, at once /update_weights_from_disk of a checkpoint in a directory of its
    own: every request ends aborted, the update succeeds and /get_model_info names the new model. (It once
    left model_path unchanged: a server started as SGLang's tests start it read updates only below its model
    directory, issue 33.)"""
    server.needs_local("it writes a second model directory the server reads")
    origin = server.get("/get_model_info").json()["model_path"]
    new = str(write_checkpoint(tmp_path / "new", seed=8))
    with ThreadPoolExecutor(6) as pool:
        futures = [
            pool.submit(
                server.post,
                "/generate",
                {
                    "text": f"Question {i}: the capital of France is",
                    "sampling_params": {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": False},
                },
            )
            for i in range(6)
        ]
        wait_running(server, in_flight=6)
        assert server.post("/abort_request", {"abort_all": True}).status_code == 200
        answer = server.post("/update_weights_from_disk", {"model_path": new})
        assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
        for future in as_completed(futures):
            assert future.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    moved = server.get("/get_model_info").json()["model_path"]
    assert moved == new and moved != origin
    server.post("/update_weights_from_disk", {"model_path": origin})
