"""Servers that fail the run, and what the run does about them.

- Servers a run starts itself, all of them dying: the run stops with exit 2 and one line, its committed
  steps intact and nothing of the failed step recorded; `--resume` starts new servers and finishes the
  run with the checksums of a run that was never disturbed; Ctrl-C stops a run too; each time no process
  the run started is left behind (and none after a clean stop either: test_sglang.py's fleet fixture).
- An SGLang-shaped server (`SGLangShaped`: `rlbench serve` behind a proxy that answers as SGLang 0.5.23's
  code does: extra meta_info keys, null texts, its two abort answers, its "NaN happened" string `matched`,
  and, on purpose, wrong answers): aborted and wrong answers are never trained. Retried, the run writes
  the undisturbed run's checksums; when every attempt fails, it stops with exit 2 naming the server and
  the field, nothing of that step recorded, and `--resume` finishes it identically.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rlbench.config import apply_overrides
from rlbench.session import run
from rlbench.errors import EngineUnavailable
from rlbench.rundir.directory import read_run
from tests.conftest import cli, small_toml, tagged_processes
from tests.cpu.conftest import ThreadedApp


def _checksums(run_dir: Path) -> bytes:
    return (run_dir / "checksums.jsonl").read_bytes()


def test_every_server_dead_stops_the_run_then_resume_finishes_it(tmp_path, reference, monkeypatch):
    """Servers the run starts itself (one `rlbench serve` behind a router it starts): the server dies at
    step 1's fourth request (a failpoint in it). No engine answers: exit 2, one line, step 0 committed
    and readable, nothing of step 1 recorded, nothing left running. Resumed, with a Ctrl-C
    (KeyboardInterrupt, as Python raises it) once its last step is committed: the reference run's
    checksums, and again nothing left running."""
    from rlbench.replay.resume import resume

    tag = uuid.uuid4().hex
    monkeypatch.setenv("RLBENCH_TEST_TAG", tag)  # inherited by every process the run starts
    (tmp_path / "s.toml").write_text(small_toml(3))
    out = tmp_path / "run"
    monkeypatch.setenv("RLBENCH_FAILPOINT", "serve.generate@12")  # the server's 12th /generate: step 1's 4th
    res = cli(
        "run",
        "-c",
        str(tmp_path / "s.toml"),
        "--rollout",
        "sglang",
        "--sglang-server",
        "rlbench",
        "--out",
        str(out),
        "--json",
    )
    monkeypatch.delenv("RLBENCH_FAILPOINT")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("rlbench: error: no SGLang server answers: http://127.0.0.1:"), lines[0]
    assert read_run(out).steps == [0] and not list((out / "rollouts").glob("000001*"))
    assert tagged_processes(tag) == []

    def interrupt(state):
        if state.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        resume(out, on_step=interrupt)
    assert read_run(out).steps == [0, 1, 2]
    assert _checksums(out) == _checksums(reference)
    assert tagged_processes(tag) == []


# ---- an SGLang-shaped server -------------------------------------------------------------------------


def _abort_running(answer: dict) -> dict:
    """SGLang 0.5.23's answer to a running request aborted (/abort_request, a pause): 200, the partial output,
    finish {"type": "abort", "message": "Aborted", "status_code": null, "err_type": null}."""
    meta = dict(answer["meta_info"])
    keep = max(len(answer["output_ids"]) // 2, 1)
    meta.update(
        finish_reason={"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
        completion_tokens=keep,
        output_token_logprobs=meta["output_token_logprobs"][:keep],
        output_token_logprobs_length=keep,
    )
    return {"text": None, "output_ids": answer["output_ids"][:keep], "meta_info": meta}


def _abort_waiting(answer: dict) -> dict:
    """SGLang 0.5.23's answer to a request aborted in the waiting queue (tokenizer_manager._handle_abort_req):
    no tokens, a short meta_info."""
    meta = answer["meta_info"]
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": meta["id"],
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": meta["weight_version"],
            "e2e_latency": 0.01,
            "input_token_logprobs": [],
            "output_token_logprobs": [],
            "output_token_logprobs_length": 0,
            "completion_tokens": 0,
        },
    }


def _nan(answer: dict) -> dict:
    """SGLang's vocabulary-boundary finish (schedule_batch._check_vocab_boundary_finish): the id replaced by
    the EOS, matched the string "NaN happened"."""
    meta = dict(answer["meta_info"], finish_reason={"type": "stop", "matched": "NaN happened"})
    return {**answer, "meta_info": meta}


def _entries(answer: dict, edit: Callable[[list], list]) -> dict:
    meta = dict(answer["meta_info"])
    meta["output_token_logprobs"] = edit([list(e) for e in meta["output_token_logprobs"]])
    ids = [e[1] for e in meta["output_token_logprobs"]]
    return {**answer, "output_ids": ids, "meta_info": meta}


WRONG = {  # answers no SGLang should give, each with the field the run must name
    "oov": (lambda a: _entries(a, lambda es: [[lp, 100_000, t] for lp, _, t in es]), "token id"),
    "negative-id": (lambda a: _entries(a, lambda es: [[lp, -3, t] for lp, _, t in es]), "token id"),
    "positive-logprob": (lambda a: _entries(a, lambda es: [[0.5, i, t] for _, i, t in es]), "logprob"),
    "too-many": (lambda a: _entries(a, lambda es: es + es + es), "at most max_new_tokens"),
    "empty-length": (
        lambda a: {
            **_entries(a, lambda es: []),
            "meta_info": {**_entries(a, lambda es: [])["meta_info"], "finish_reason": {"type": "length", "length": 4}},
        },
        "length only with exactly max_new_tokens",
    ),
}


GARBAGE = {  # a 200 answer no SGLang gives, per endpoint the client reads: text where JSON belongs, or another shape
    "/generate": "<html>upstream hiccup</html>",
    "/update_weights_from_disk": "<html>upstream hiccup</html>",
    "/weights_checker": '{"success": true, "ranks": "all fine"}',
    "/get_weights_by_name": '{"values": "elided"}',
    "/server_info": "[1, 2, 3]",
    "/workers": '{"workers": 5}',
}


class SGLangShaped(ThreadedApp):
    """`rlbench serve` (on a thread, the run's model and seed) behind an aiohttp proxy (on a thread) that
    answers /generate as SGLang 0.5.23 does: every answer with extra meta_info keys and a null text, and the
    n-th answer rewritten by `plan(n, answer, request body)` (an abort, a wrong answer, or itself). The other
    routes pass through, unless `faults` names their path: "500" (SGLang's internal error), "garbage" (200 with
    GARBAGE's answer), "nothing" (the connection closed unanswered), "gone" (from then on every connection
    closed unanswered: a dead server), "hang" (the request read and never answered, until `close()`), "lie"
    (/weights_checker: one tensor's hash changed, so the client fetches it with /get_weights_by_name)."""

    def __init__(self, config, plan: Callable[[int, dict, dict], dict] = lambda n, answer, body: answer):
        from aiohttp import web

        from rlbench.serve.server import ServeConfig, serve_in_thread

        self.backend = serve_in_thread(
            ServeConfig(
                model_path=config.model.path,
                tokenizer_path=config.model.tokenizer,
                # the run's initial weights, as its own fleet starts a server (backends/sglang/fleet.py): the
                # model's checkpoint, or random weights from its seed
                load_format="auto" if config.model.init == "checkpoint" else "dummy",
                port=0,
                random_seed=config.seed,
                dtype=config.model.dtype,
                threads=config.threads,
                decode=config.rollout.decode,
                decode_batch_size=config.rollout.decode_batch_size,
                weights_dir=tempfile.gettempdir(),
            )
        )  # where the run's engine writes its weight versions
        self.plan, self.count, self.rewritten = plan, 0, 0
        self.faults: dict[str, str] = {}
        self.gone = False
        self.released = asyncio.Event()  # what a hung request waits for (set by close())
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._proxy)
        super().__init__(app)

    async def _proxy(self, request):
        import aiohttp
        from aiohttp import web

        fault = self.faults.get(request.path)
        self.gone = self.gone or fault == "gone"
        if fault == "nothing" or self.gone:
            request.transport.close()
            return web.Response()  # never sent: the connection is closed
        if fault == "500":
            return web.Response(status=500, text="Internal Server Error")
        if fault == "garbage":
            return web.Response(status=200, text=GARBAGE[request.path], content_type="application/json")
        body = await request.read()
        if fault == "hang":
            await self.released.wait()
            return web.Response(status=503)
        async with aiohttp.ClientSession() as session:
            async with session.request(
                request.method, self.backend.url + request.path, data=body, headers={"Content-Type": "application/json"}
            ) as answer:
                raw, status = await answer.read(), answer.status
        import json

        if fault == "lie":
            lied = json.loads(raw)
            name = next(iter(lied["ranks"][0]["checksums"]))
            lied["ranks"][0]["checksums"][name] = "0" * 16
            return web.json_response(lied)
        if request.path != "/generate" or status != 200:
            return web.Response(body=raw, status=status, content_type="application/json")

        answer = json.loads(raw)
        answer["meta_info"]["response_sent_to_client_ts"] = time.time()  # what a finished 0.5.23 answer adds
        answer["meta_info"]["dp_rank"] = 0
        answer["text"] = None
        self.count += 1
        shaped = self.plan(self.count, answer, json.loads(body))
        self.rewritten += shaped is not answer
        return web.json_response(shaped)

    def close(self):
        self.loop.call_soon_threadsafe(self.released.set)
        super().close()
        self.backend.close()


def _through(config, server: SGLangShaped, out: Path, **overrides):
    return apply_overrides(
        config,
        out=str(out),
        rollout__backend="sglang",
        rollout__external_engine_addrs=(server.url,),
        rollout__use_router=False,
        **overrides,
    )


def test_aborted_and_wrong_answers_are_retried_and_the_run_is_the_reference(small_config, reference, tmp_path):
    """Every 5th answer aborted (running or waiting form, by turns), every 7th a "NaN happened" stop, every
    11th a wrong one: all retried with their seeds, the run writes the undisturbed run's checksums."""
    kinds = list(WRONG.values())

    def plan(n, answer, _body):
        if n % 5 == 0:
            return (_abort_running if n % 10 else _abort_waiting)(answer)
        if n % 7 == 0:
            return _nan(answer)
        if n % 11 == 0:
            return kinds[(n // 11) % len(kinds)][0](answer)
        return answer

    server = SGLangShaped(small_config, plan)
    try:
        run(_through(small_config, server, tmp_path / "run"))
        assert server.rewritten >= 8
    finally:
        server.close()
    assert _checksums(tmp_path / "run") == _checksums(reference)


def test_a_server_that_always_answers_wrongly_names_the_field(small_config):
    """A server whose every answer to a request is wrong in one way (by the request's seed: each way in
    turn): the request fails after its attempts with EngineUnavailable (exit 2) naming the server and the
    field; nothing is returned to train on."""
    from rlbench.backends.sglang.client import Client
    from rlbench.backends.sglang.engine import SGLangEngine
    from rlbench.backends.sglang.fleet import Fleet
    from rlbench.core.types import GenerateRequest

    kinds = sorted(WRONG)

    def plan(_n, answer, body):
        return WRONG[kinds[body["sampling_params"]["sampling_seed"]]][0](answer)

    server = SGLangShaped(small_config, plan)
    config = _through(small_config, server, Path("unused"), rollout__request_attempts=2)
    engine = SGLangEngine(config, Fleet(route=[server.url], workers=[server.url]), Client(8, 30))
    try:
        for seed, kind in enumerate(kinds):
            with pytest.raises(
                EngineUnavailable,
                match=rf"failed 2 times, the last: {server.url}/generate: "
                rf".*{WRONG[kind][1]}",
            ):
                engine.generate([GenerateRequest((5, 6, 7), seed, 4, 1.0, (2,))])
    finally:
        engine.close()
        server.close()


def test_a_step_whose_answers_all_abort_stops_the_run_and_resume_finishes_it(small_config, reference, tmp_path):
    """Every answer of step 1 aborted: exit 2 (EngineUnavailable) naming the server and the abort, step 0
    committed and nothing of step 1 recorded; resumed against the healthy server, the run's checksums are
    the undisturbed run's."""
    per_step = small_config.data.prompts_per_step * small_config.rollout.n_samples_per_prompt
    broken = {"on": True}

    def plan(n, answer, _body):
        return _abort_running(answer) if broken["on"] and n > per_step else answer

    from rlbench.replay.resume import resume

    server = SGLangShaped(small_config, plan)
    out = tmp_path / "run"
    try:
        with pytest.raises(
            EngineUnavailable,
            match=rf"{server.url}/generate: meta_info.finish_reason: the server "
            r"aborted the request \(Aborted\)",
        ):
            run(_through(small_config, server, out, rollout__request_attempts=2))
        assert read_run(out).steps == [0] and not list((out / "rollouts").glob("000001*"))
        broken["on"] = False
        resume(out)
    finally:
        server.close()
    assert _checksums(out) == _checksums(reference)


# ---- every endpoint the client calls fails cleanly ----------------------------------------------------


@pytest.fixture(scope="module")
def shaped(small_config):
    """One SGLang-shaped server for the endpoint faults below; each test sets its `faults` (reset after)."""
    server = SGLangShaped(small_config)
    yield server
    server.close()


@pytest.fixture
def faulty(shaped, monkeypatch):
    monkeypatch.setattr("rlbench.backends.sglang.engine.BACKOFF_S", 0.001)  # retries, without the waits
    shaped.faults, shaped.gone = {}, False
    yield shaped
    shaped.faults, shaped.gone = {}, False


SAID = {  # what the line quotes of each fault's answer
    "500": "500 Internal Server Error",
    "nothing": "ServerDisconnectedError: Server disconnected",
    "garbage": {
        "/generate": "got <html>upstream hiccup</html>",
        "/update_weights_from_disk": "upstream hiccup",
        "/weights_checker": "ranks: expected a non-empty list",
        "/get_weights_by_name": "'elided'",
        "/server_info": "got [1, 2, 3]",
        "/workers": "workers: expected a list of workers, got 5",
    },
}
ENDPOINTS = {  # each endpoint a run calls, in the order it first calls them, with what gets the run there
    "/server_info": {},
    "/generate": {},
    "/update_weights_from_disk": {},
    "/flush_cache": {},
    "/weights_checker": {},
    "/get_weights_by_name": {"/weights_checker": "lie"},
}
CASES = [
    (endpoint, fault) for endpoint in ENDPOINTS for fault in SAID if (endpoint, fault) != ("/flush_cache", "garbage")
]  # SGLang's /flush_cache answers text: any 200 is its


def _cli_run(tmp_path: Path, *where: str, rollout: str = ""):
    toml = small_toml(1).replace("[rollout]\n", f"[rollout]\nrequest_attempts = 2\nuse_router = false\n{rollout}")
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "s.toml").write_text(toml)
    return cli("run", "-c", str(tmp_path / "s.toml"), "--rollout", "sglang", *where, "--out", str(tmp_path / "run"))


def _one_line(res) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("rlbench: error: ") and "internal error" not in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("endpoint, fault", CASES)
def test_every_endpoint_answering_500_garbage_or_nothing_stops_the_run_with_one_line(faulty, tmp_path, endpoint, fault):
    """A server answering 500, a garbled 200 (text where JSON belongs, or JSON of another shape) or nothing (the
    connection closed) on one endpoint, every time: the call is tried again (rollout.request_attempts), then the
    run stops with exit 2 and one line naming the server, the endpoint and the answer; never an internal error."""
    faulty.faults = {**ENDPOINTS[endpoint], endpoint: fault}
    line = _one_line(_cli_run(tmp_path, "--rollout-external-engine-addrs", faulty.url))
    said = SAID[fault] if isinstance(SAID[fault], str) else SAID[fault][endpoint]
    assert f"{endpoint} failed 2 times, the last: " in line and f"{faulty.url}{endpoint}" in line and said in line, line


@pytest.mark.parametrize("fault", sorted(SAID))
def test_a_router_whose_workers_list_fails_stops_the_run_with_one_line(faulty, tmp_path, fault):
    """sglang-router named by the run (rollout.sglang_router_url): its GET /workers answering 500, garbage or
    nothing is the same one line, naming the router and the endpoint."""
    faulty.faults = {"/workers": fault}
    line = _one_line(_cli_run(tmp_path, "--sglang-router-url", faulty.url))
    said = SAID[fault] if isinstance(SAID[fault], str) else SAID[fault]["/workers"]
    assert f"/workers failed 2 times, the last: GET {faulty.url}/workers: " in line and said in line, line


def test_a_server_that_refuses_connections_or_dies_at_a_weight_sync_is_named_with_the_endpoint(faulty, tmp_path):
    """Nothing listening at the address: the first call (/server_info) is refused, one line naming it. A server
    that dies at the weight sync (every connection dropped from then on, /model_info too): it is dropped, and with
    none left the line names it and the call that found it gone."""
    from rlbench.backends.sglang.fleet import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    line = _one_line(_cli_run(tmp_path / "refused", "--rollout-external-engine-addrs", closed))
    assert f"/server_info failed 2 times, the last: GET {closed}/server_info: ClientConnectorError" in line, line

    faulty.faults = {"/update_weights_from_disk": "gone"}
    line = _one_line(_cli_run(tmp_path / "gone", "--rollout-external-engine-addrs", faulty.url))
    assert line.startswith(
        f"rlbench: error: no SGLang server answers: {faulty.url} is gone (the last failure: POST "
        f"{faulty.url}/update_weights_from_disk: ServerDisconnectedError"
    ), line


def test_the_probes_name_what_they_got(faulty, small_config):
    """/health_generate (has a server rlbench started come up?) answering 500 until the wait ends: the line
    quotes its last answer. A router's /workers answering garbage while the client removes a dead server from
    it: the removal is given up (the router's own retries go elsewhere), no error of its own."""
    import subprocess

    from rlbench.backends.sglang.client import Client
    from rlbench.backends.sglang.engine import SGLangEngine
    from rlbench.backends.sglang.fleet import Fleet, Process, not_ready, wait_server

    faulty.faults = {"/health_generate": "500", "/workers": "garbage"}
    client = Client(4, 10)
    engine = SGLangEngine(
        _through(small_config, faulty, Path("unused")),
        Fleet(route=[faulty.url], workers=[faulty.url], router=faulty.url),
        client,
    )
    proc = Process("server-0", subprocess.Popen(["sleep", "30"]), Path("/nonexistent.log"), url=faulty.url)
    try:
        with pytest.raises(
            EngineUnavailable,
            match=rf"the last answer: GET {faulty.url}/health_generate: 500 "
            r"Internal Server Error",
        ):
            wait_server(proc, lambda url: client.run(not_ready(client, url)), timeout_s=0.5)
        client.run(engine._unregister([faulty.url]))
    finally:
        proc.popen.kill()
        proc.popen.wait()
        engine.close()


# ---- every call ends within rollout.request_timeout ------------------------------------------------------


def test_a_server_that_never_answers_generate_stops_the_run_after_the_request_timeout(faulty, tmp_path):
    """A server that reads each /generate and never answers: every attempt ends at rollout.request_timeout (the
    client once handed aiohttp no timeout for a call that gave none, and aiohttp waits forever then), and the run
    stops with exit 2 and one line naming the timeout. The test waits on the run's exit, not on a clock."""
    faulty.faults = {"/generate": "hang"}
    res = _cli_run(tmp_path, "--rollout-external-engine-addrs", faulty.url, rollout="request_timeout = 0.5\n")
    line, said = _one_line(res), f"POST {faulty.url}/generate: TimeoutError: no answer within 0.5 s"
    assert f"/generate failed 2 times, the last: {said}" in line, line
    assert not list((tmp_path / "run" / "rollouts").glob("*"))  # nothing of the step recorded


@pytest.mark.parametrize("asked", [None, 30.0], ids=["no timeout given", "a longer one given"])
def test_every_client_call_ends_at_the_configured_timeout(asked):
    """Client.call against a raw socket server that reads the request and never answers: whether the call gives
    no timeout of its own or a longer one, it fails at the configured one (Retryable, naming it), in the same
    event loop as the server, so nothing but the client's timeout can end it."""
    from rlbench.backends.sglang.client import Client, Retryable

    client = Client(4, 0.5)

    async def scenario():
        released = asyncio.Event()

        async def hold(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await released.wait()
            writer.close()

        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/generate"
        try:
            with pytest.raises(Retryable, match=rf"^POST {url}: TimeoutError: no answer within 0.5 s$") as caught:
                await client.call("POST", url, {"input_ids": [1]}, timeout_s=asked)
            assert not caught.value.unreachable  # a slow server, not a dead one
        finally:
            released.set()
            server.close()
            await server.wait_closed()

    try:
        client.run(scenario())
    finally:
        client.close()
