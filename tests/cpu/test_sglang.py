"""The SGLang rollout path through the real sglang-router in front of `rlbench serve` workers.

Two workers and a router are started once for the module's tests that share them (one xdist group,
so one worker process runs them all, in this order): a run through the router writes the in-process
run's checksums.jsonl; the client sends no field the router drops; the conformance module passes
against a worker; a fuzz over /generate bodies gets 4xx answers, never a 5xx, never a dead server;
an engine holding other weights than the trainer's stops the run, naming the element; a worker
SIGKILLed while it holds requests changes nothing (test_sglang_faults.py: every server dead).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import uuid
from pathlib import Path

import pytest

from rlbench.config import apply_overrides
from rlbench.session import run
from rlbench.errors import WeightMismatch
from rlbench.rundir.directory import read_run
from tests.conformance.test_sglang_api import *  # noqa: F401,F403 - the conformance tests, run against `fleet`
from tests.conftest import tagged_processes
from tests.cpu.conftest import ThreadedApp

# One xdist worker runs every test of this module (the conformance tests imported above too), so
# the fleet is started once: `--dist loadgroup` (pyproject.toml) keeps a group on one worker.
pytestmark = pytest.mark.xdist_group("sglang-fleet")


def _sglang(config, **overrides):
    return apply_overrides(config, rollout__backend="sglang", **overrides)


@pytest.fixture(scope="module")
def fleet(small_config):
    """Two `rlbench serve` workers and sglang-router in front of them, started as a run starts them, and
    stopped as a run that ends well stops them: afterwards, no process they started is left."""
    from rlbench.backends.sglang.engine import open_engine

    tag = uuid.uuid4().hex
    os.environ["RLBENCH_TEST_TAG"] = tag  # inherited by the processes started now
    try:
        engine = open_engine(
            _sglang(small_config, rollout__sglang_server="rlbench", rollout__num_engines=2).engine_setup()
        )
    finally:
        del os.environ["RLBENCH_TEST_TAG"]
    try:
        yield engine.fleet
    finally:
        engine.close()
    assert tagged_processes(tag) == []


@pytest.fixture(scope="module")
def sglang_url(fleet) -> str:  # the conformance module's tests, against the first worker
    return fleet.workers[0]


def _checksums(run_dir: Path) -> bytes:
    return (run_dir / "checksums.jsonl").read_bytes()


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_run(run_dir).metrics]


def test_a_run_through_the_router_is_the_in_process_run(small_config, fleet, reference, tmp_path):
    out = tmp_path / "routed"
    run(_sglang(small_config, out=str(out), rollout__sglang_router_url=fleet.router))
    assert _checksums(out) == _checksums(reference)
    assert len(read_run(out).steps) == small_config.steps and _metrics(out) == _metrics(reference)
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["engines"]) == sorted(fleet.workers)
    assert manifest["versions"]["sglang-router"]


class _Recorder(ThreadedApp):
    """A stand-in SGLang worker that keeps every /generate body it receives and answers with a fixed,
    well-formed answer (and /weights_checker with `checksum`)."""

    ANSWER = {
        "text": "",
        "output_ids": [5, 2],
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": "default",
            "output_token_logprobs": [[-0.5, 5, None], [-0.25, 2, None]],
        },
    }

    def __init__(self, checksum: dict | None = None):
        from aiohttp import web

        self.bodies: list[dict] = []
        app = web.Application()

        async def generate(request):
            self.bodies.append(await request.json())
            return web.json_response(self.ANSWER)

        async def weights_checker(_request):
            return web.json_response(checksum)

        async def health(_request):
            return web.Response()

        async def info(_request):
            return web.json_response({"model_path": "/nowhere", "is_generation": True})

        app.router.add_post("/generate", generate)
        app.router.add_post("/weights_checker", weights_checker)
        app.router.add_get("/health", health)
        app.router.add_get("/server_info", info)
        app.router.add_get("/model_info", info)
        super().__init__(app)


def _missing(sent: dict, received: dict, prefix: str = "") -> list[str]:
    """The fields of `sent` that `received` lacks or holds with another value (dotted names)."""
    out = []
    for key, value in sent.items():
        if isinstance(value, dict) and isinstance(received.get(key), dict):
            out += _missing(value, received[key], f"{prefix}{key}.")
        elif key not in received or received[key] != value or type(received[key]) is not type(value):
            out.append(f"{prefix}{key}")
    return out


def test_the_client_sends_no_field_the_router_drops():
    """Every field the client sends reaches the worker through the real router with its value (the
    router re-serialises the request and adds its defaults: `stream`, `log_metrics`, ...); and the
    comparison can fail: a `seed` in sampling_params, a field the router drops, does not arrive."""
    from rlbench.backends.sglang import wire
    from rlbench.backends.sglang.client import Client
    from rlbench.backends.sglang.fleet import Fleet, make_logs, registered, start_router
    from rlbench.core.types import GenerateRequest

    recorder, client = _Recorder(), Client(8, 60)
    fleet = Fleet(route=[], workers=[recorder.url], logs=make_logs())
    try:
        start_router(fleet, lambda url: client.run(registered(client, url)))
        request = GenerateRequest((1, 2, 3), 2**62 + 12345, 7, 0.7, (2, 9), 5, 0.9)
        sent = wire.request_body(request)
        answer = client.run(client.ok("POST", f"{fleet.router}/generate", sent))
        assert len(recorder.bodies) == 1 and _missing(sent, recorder.bodies[0]) == []
        assert wire.parse_answer(answer, fleet.router, request, 314).logprobs == (-0.5, -0.25)
        dropped = json.loads(json.dumps(sent))
        dropped["sampling_params"]["seed"] = 7
        client.run(client.ok("POST", f"{fleet.router}/generate", dropped))
        assert _missing(dropped, recorder.bodies[1]) == ["sampling_params.seed"]
    finally:
        client.close()
        fleet.close()
        recorder.close()


def test_a_router_whose_port_another_process_took_starts_again_on_fresh_ports(monkeypatch):
    """free_port's port is free when chosen, not when the router binds it: a router that exits with its port taken
    is started again on fresh ports; after PORT_TRIES such exits, and at once for any other exit, the run stops
    with the router's own last lines."""
    import socket

    from rlbench.backends.sglang import fleet as fleet_module
    from rlbench.backends.sglang.client import Client
    from rlbench.backends.sglang.fleet import Fleet, make_logs, registered, start_router
    from rlbench.errors import EngineUnavailable

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # bound, not listening: the router cannot bind it, a client is refused at once
    real, calls = fleet_module.free_port, []

    def port(times: int):
        def free_port():  # the router's port: the taken one, `times` times
            calls.append(1)
            return taken.getsockname()[1] if len(calls) % 2 == 1 and len(calls) <= 2 * times else real()

        return free_port

    recorder, client = _Recorder(), Client(8, 60)
    try:
        monkeypatch.setattr(fleet_module, "free_port", port(2))
        fleet = Fleet(route=[], workers=[recorder.url], logs=make_logs())
        try:
            start_router(fleet, lambda url: client.run(registered(client, url)))
            assert len(calls) == 6  # two routers on the taken port, then one on fresh ports
            assert len(fleet.processes) == 1 and fleet.router != f"http://127.0.0.1:{taken.getsockname()[1]}"
        finally:
            fleet.close()
        calls.clear()
        monkeypatch.setattr(fleet_module, "free_port", port(fleet_module.PORT_TRIES))
        fleet = Fleet(route=[], workers=[recorder.url], logs=make_logs())
        try:
            with pytest.raises(EngineUnavailable, match="Address already in use") as stopped:
                start_router(fleet, lambda url: client.run(registered(client, url)))
            assert str(stopped.value).startswith("sglang-router exited with code ")
            assert len(calls) == 2 * fleet_module.PORT_TRIES and fleet.processes == []
        finally:
            fleet.close()
        calls.clear()
        monkeypatch.setattr(fleet_module, "free_port", port(0))
        exits = [sys.executable, "-c", "import sys; print('another failure', file=sys.stderr); sys.exit(3)"]
        monkeypatch.setattr(fleet_module, "router_command", lambda *_: exits)
        fleet = Fleet(route=[], workers=[recorder.url], logs=make_logs())
        try:
            with pytest.raises(EngineUnavailable) as stopped:
                start_router(fleet, lambda url: client.run(registered(client, url)))
            assert str(stopped.value) == "sglang-router exited with code 3 (its last lines: another failure)"
            assert len(calls) == 2  # one router: not started again
        finally:
            fleet.close()
    finally:
        client.close()
        recorder.close()
        taken.close()


def test_a_fuzz_over_generate_bodies_gets_4xx_never_5xx(fleet):
    from hypothesis import HealthCheck, given, settings, strategies as st

    from rlbench.backends.sglang.client import Client

    url = fleet.workers[0]
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)
    )
    values = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=12,
    )
    valid = st.fixed_dictionaries(
        {
            "input_ids": st.lists(st.integers(0, 313), min_size=1, max_size=6),
            "sampling_params": st.fixed_dictionaries(
                {"max_new_tokens": st.integers(0, 3)},
                optional={
                    "temperature": st.floats(0, 2),
                    "top_p": st.floats(0.01, 1),
                    "top_k": st.sampled_from([-1, 1, 5, 400]),
                    "sampling_seed": st.integers(0, 2**63 - 1),
                    "stop_token_ids": st.lists(st.integers(0, 313)),
                },
            ),
        },
        optional={"return_logprob": st.booleans(), "rid": st.text(max_size=4)},
    )
    top = [
        "input_ids",
        "text",
        "input_embeds",
        "sampling_params",
        "return_logprob",
        "rid",
        "stream",
        "top_logprobs_num",
        "extra",
    ]
    inner = [
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "sampling_seed",
        "stop_token_ids",
        "seed",
        "n",
        "stop",
        "min_p",
    ]

    def mutate(body: dict, where: str, value) -> dict:  # one field of a valid body set to anything
        body = json.loads(json.dumps(body))
        if where in inner:
            body["sampling_params"][where] = value
        else:
            body[where] = value
        return body

    bodies = st.one_of(valid, values, st.builds(mutate, valid, st.sampled_from(top + inner), values))
    client = Client(4, 60)
    seen = {"2xx": 0, "4xx": 0}

    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(bodies)
    def answer(body):
        raw = json.dumps(body).encode()  # any JSON: integers past 64 bits, Infinity
        status, data = client.run(client.call("POST", f"{url}/generate", raw))  # a 5xx raises Retryable
        assert status < 500, (status, data)
        if status >= 400:
            assert isinstance(data, dict) and ("error" in data or data.get("object") == "error"), data
        seen["2xx" if status < 300 else "4xx"] += 1

    try:
        answer()
        status, _ = client.run(client.call("GET", f"{url}/health_generate"))
        assert status == 200
        assert seen["2xx"] >= 10 and seen["4xx"] >= 10, seen  # both kinds of body were tried
        # No such route, or not that method: JSON, as SGLang's (FastAPI) server answers.
        assert client.run(client.call("GET", f"{url}/no_such_route")) == (404, {"detail": "Not Found"})
        assert client.run(client.call("GET", f"{url}/generate")) == (405, {"detail": "Method Not Allowed"})
    finally:
        client.close()


def test_an_engine_holding_other_weights_stops_the_run(small_config, fleet, tmp_path, monkeypatch):
    """Servers that load a changed value (one element of one tensor): the weight-update check reads
    the servers' checksums, fetches the differing tensor and names the element, exit 1 (WeightMismatch)."""
    from rlbench.backends.sglang.engine import SGLangEngine

    write = SGLangEngine._write
    sent = []  # the trainer's value of the element, as each lossy sync sent it before changing it

    def lossy(self, weights, version):
        if version >= 1:
            weights = dict(weights)
            sent.append(float(weights["model.norm.weight"][5]))
            weights["model.norm.weight"] = weights["model.norm.weight"].clone()
            weights["model.norm.weight"][5] = 0.0
        return write(self, weights, version)

    monkeypatch.setattr(SGLangEngine, "_write", lossy)
    with pytest.raises(WeightMismatch) as info:
        run(_sglang(small_config, out=str(tmp_path / "lossy"), rollout__sglang_router_url=fleet.router))
    # the trainer's value is whatever step 0 trained it to (it depends on the initial weights and the settings):
    # the message names the one the first sync sent
    assert sent[0] != 0.0
    assert re.fullmatch(
        r"step 0, sync: engine http://127\.0\.0\.1:\d+ weights differ from the trainer's at "
        rf"model\.norm\.weight\[5\] \(element 5 of 64\): trainer {re.escape(repr(sent[0]))}, engine 0\.0",
        str(info.value),
    ), str(info.value)
    assert not (tmp_path / "lossy").exists()  # nothing was committed


def test_a_worker_killed_while_it_holds_requests_changes_nothing(small_config, fleet, reference, tmp_path, monkeypatch):
    """SIGKILL the second worker when step 1's fourth request goes out through the router (the first
    three are in flight): whatever it held is retried on the other engine (by the router, else by the
    client), with its own seed, and the run writes the undisturbed run's checksums."""
    from rlbench.backends.sglang.client import Client

    victim = next(p for p in fleet.processes if p.name == "server-1")  # fleet.workers[1]
    call, sent = Client.call, []

    async def call_and_kill(self, method, url, body=None, timeout_s=None):
        if url.endswith("/generate"):
            sent.append(url)
            if len(sent) == small_config.samples_per_step + 4:
                os.kill(victim.popen.pid, signal.SIGKILL)
        return await call(self, method, url, body, timeout_s)

    monkeypatch.setattr(Client, "call", call_and_kill)
    out = tmp_path / "killed"
    run(_sglang(small_config, out=str(out), rollout__sglang_router_url=fleet.router))
    assert victim.popen.wait(10) == -signal.SIGKILL and len(sent) >= small_config.samples_per_step + 4
    assert _checksums(out) == _checksums(reference)


def test_without_a_router_the_client_retries_on_another_engine(small_config):
    """The client's own retry: requests spread over a dead server and a live one all get answered by
    the live one, and the dead one is dropped from the engine's servers."""
    from rlbench.backends.sglang.client import Client
    from rlbench.backends.sglang.engine import SGLangEngine
    from rlbench.backends.sglang.fleet import Fleet, free_port
    from rlbench.core.types import GenerateRequest

    recorder, dead = _Recorder(), f"http://127.0.0.1:{free_port()}"
    servers = [dead, recorder.url]
    config = _sglang(small_config, rollout__external_engine_addrs=tuple(servers), rollout__use_router=False)
    engine = SGLangEngine(config, Fleet(route=list(servers), workers=list(servers)), Client(8, 30))
    try:
        results = engine.generate([GenerateRequest((1, 2, 3), seed, 2, 1.0, (2,)) for seed in range(6)])
        assert [r.output_ids for r in results] == [(5, 2)] * 6 and len(recorder.bodies) == 6
        assert sorted(b["sampling_params"]["sampling_seed"] for b in recorder.bodies) == list(range(6))
        assert engine.fleet.workers == [recorder.url] and engine.fleet.route == [recorder.url]
    finally:
        engine.close()
        recorder.close()


@pytest.mark.parametrize("ranks", [1, 2])
def test_weight_checksums_are_the_run_directorys_where_sglangs_hash_agrees(small_config, ranks):
    """The client holds SGLang's /weights_checker hashes to the same hash of what it pushed: a tensor that
    agrees is reported by its run-directory digest (rundir/digest.py, what the weight-update check compares),
    one that differs by the server's hash; an answer sharded over two ranks cannot be compared (exit 2)."""
    import torch

    from rlbench.backends.sglang import wire
    from rlbench.backends.sglang.client import Client
    from rlbench.backends.sglang.engine import SGLangEngine
    from rlbench.backends.sglang.fleet import Fleet
    from rlbench.errors import BadInput
    from rlbench.rundir.digest import tensor_digests

    pushed = {"a": torch.ones(3), "b": torch.zeros(2)}
    held = {"a": wire.tensor_hash(pushed["a"]), "b": "f" * 16}
    rank = {"checksums": held, "per_gpu_checksum": "x", "parallelism_info": [{"role": "target"}]}
    recorder = _Recorder({"success": True, "message": "Success.", "ranks": [rank] * ranks, "per_engine_checksum": "y"})
    config = _sglang(small_config, rollout__external_engine_addrs=(recorder.url,), rollout__use_router=False)
    engine = SGLangEngine(config, Fleet(route=[recorder.url], workers=[recorder.url]), Client(8, 30))
    engine._pushed, engine.server_info = pushed, {recorder.url: {"server": "rlbench serve"}}
    try:
        if ranks == 1:
            reported = {"a": tensor_digests(pushed)["a"], "b": "sglang:" + "f" * 16}
            assert engine.weight_checksums() == {recorder.url: reported}
        else:
            with pytest.raises(
                BadInput,
                match=r"/weights_checker: the trainer's weights cannot be compared with this "
                r"server's: its weights are sharded over 2 ranks, each hashed alone; ",
            ):
                engine.weight_checksums()
    finally:
        engine.close()
        recorder.close()
