"""`rlbench serve --api-key` as SGLang's server does it: a request without the key gets 401
{"error": "Unauthorized"} and changes nothing, /health* stays open; beyond loopback without a key the
server refuses to start unless --allow-unauthenticated (and then --weights-dir); weight updates read only
below --weights-dir where it is given, anything readable on loopback or with a key, as SGLang; the client sends
RLBENCH_SGLANG_API_KEY and the key shows nowhere; with it
set, `rlbench run --rollout sglang` starts keyed workers behind sglang-router and writes the in-process run's
checksums, byte for byte."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlbench.backends.sglang.client import Client
from rlbench.config import load_config
from rlbench.config_sections import FIXTURES
from rlbench.errors import BadInput
from rlbench.serve.auth import authorized
from rlbench.serve.server import ServeConfig, serve_in_thread
from tests.conftest import cli, small_toml

KEY = "k3y-not-to-be-seen"
MODEL = str(FIXTURES / "models" / "tiny-qwen3")


def _call(url: str, path: str, body=None, key: str | None = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url}{path}",
        data=data,
        method="POST" if body is not None else "GET",
        headers={"Content-Type": "application/json"},
    )
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            raw, status = answer.read(), answer.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    return status, json.loads(raw) if raw else None


@pytest.fixture(scope="module")
def keyed():
    serving = serve_in_thread(
        # the weightless fixture with seeded weights: a weight update from its directory loads those again
        ServeConfig(
            model_path=MODEL,
            load_format="dummy",
            port=0,
            api_key=KEY,
            decode_batch_size=4,
            batch_wait_ms=1.0,
            weights_dir=MODEL,
        )
    )
    try:
        yield serving
    finally:
        serving.close()


def _checksum(url: str) -> str:
    status, answer = _call(url, "/weights_checker", {"action": "checksum"}, KEY)
    assert status == 200
    return answer["ranks"][0]["per_gpu_checksum"]


def test_without_the_key_401_and_nothing_changes(keyed, tmp_path):
    before = _checksum(keyed.url)
    for key in (None, "wrong", ""):
        for path, body in [
            ("/update_weights_from_disk", {"model_path": MODEL}),
            ("/server_info", None),
            ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
            ("/update_weight_version", {"new_version": "x"}),
        ]:
            assert _call(keyed.url, path, body, key) == (401, {"error": "Unauthorized"}), (path, key)
    assert _call(keyed.url, "/health", key=None)[0] == 200  # probes stay open, as in SGLang
    assert _checksum(keyed.url) == before
    status, info = _call(keyed.url, "/server_info", key=KEY)
    assert status == 200 and info["weight_version"] == "default"
    assert KEY not in json.dumps(info) and KEY not in repr(keyed.state.config)


def test_with_the_key_200_and_weights_only_from_below_the_allowed_directory(keyed, tmp_path):
    status, answer = _call(keyed.url, "/update_weights_from_disk", {"model_path": MODEL, "weight_version": "v1"}, KEY)
    assert status == 200 and answer["success"], answer
    before = _checksum(keyed.url)
    for outside in (str(tmp_path), "/etc", f"{MODEL}/../.."):
        status, answer = _call(
            keyed.url, "/update_weights_from_disk", {"model_path": outside, "weight_version": "v2"}, KEY
        )
        assert status == 400 and answer["success"] is False and "outside" in answer["message"], answer
    assert _checksum(keyed.url) == before
    assert _call(keyed.url, "/server_info", key=KEY)[1]["weight_version"] == "v1"


def test_where_weight_updates_may_read_from(tmp_path):
    """SGLang's rule where only trusted callers reach the server (loopback, or a key): any readable path;
    --weights-dir narrows it; beyond loopback without a key --weights-dir is required, so no unauthenticated
    request can name an arbitrary file."""
    from rlbench.serve.bodies import outside_root

    assert ServeConfig().weights_root() is None and outside_root("/etc", None) is None
    assert ServeConfig(host="0.0.0.0", api_key=KEY).weights_root() is None
    narrowed = ServeConfig(weights_dir=str(tmp_path)).weights_root()
    assert narrowed == tmp_path.resolve() and outside_root(str(tmp_path / "v1"), narrowed) is None
    assert "outside" in outside_root("/etc", narrowed) and "outside" in outside_root(f"{tmp_path}/../x", narrowed)
    with pytest.raises(BadInput, match="--weights-dir: refusing to serve on 0.0.0.0 without a key and without"):
        ServeConfig(host="0.0.0.0", allow_unauthenticated=True)
    exposed = ServeConfig(host="0.0.0.0", allow_unauthenticated=True, weights_dir=str(tmp_path))
    assert exposed.weights_root() == tmp_path.resolve()
    res = cli("serve", "--host", "0.0.0.0", "--port", "0", "--allow-unauthenticated")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "--weights-dir" in lines[0], res.stderr


def test_the_client_sends_the_key_from_the_environment(keyed, monkeypatch):
    monkeypatch.setenv("RLBENCH_SGLANG_API_KEY", KEY)
    client = Client(2, 30)
    try:
        assert client.run(client.ok("GET", f"{keyed.url}/model_info"))["weight_version"]
    finally:
        client.close()
    monkeypatch.setenv("RLBENCH_SGLANG_API_KEY", "wrong")
    client = Client(2, 30)
    try:
        with pytest.raises(BadInput, match="401 Unauthorized.*was refused") as refused:
            client.run(client.ok("GET", f"{keyed.url}/model_info"))
    finally:
        client.close()
    assert KEY not in str(refused.value) and "wrong" not in str(refused.value)


def test_sglangs_auth_rule():
    assert authorized("GET", "/health_generate", None, KEY) and authorized("OPTIONS", "/generate", None, KEY)
    assert authorized("POST", "/generate", f"bearer {KEY}", KEY)
    assert not authorized("POST", "/generate", KEY, KEY) and not authorized("POST", "/generate", "Bearer ", KEY)


def test_beyond_loopback_needs_a_key_or_to_be_told(tmp_path):
    res = cli("serve", "--host", "0.0.0.0", "--port", "0")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "--allow-unauthenticated" in lines[0], res.stderr
    assert ServeConfig(host="0.0.0.0", allow_unauthenticated=True, weights_dir="/srv/w").host == "0.0.0.0"
    assert ServeConfig(host="0.0.0.0", api_key=KEY).api_key == KEY
    with pytest.raises(BadInput, match="--api-key: expected a non-empty string"):
        ServeConfig(api_key=" ")


def test_the_key_goes_to_workers_by_environment_never_the_command_line_or_the_manifest(monkeypatch):
    from dataclasses import asdict

    from rlbench.backends.sglang.fleet import server_command, server_env

    monkeypatch.setenv("RLBENCH_SGLANG_API_KEY", KEY)
    config = load_config(rollout__backend="sglang", rollout__sglang_server="rlbench").engine_setup()
    assert KEY not in " ".join(server_command(config, "127.0.0.1", 0))
    assert server_env(config)["RLBENCH_SERVE_API_KEY"] == KEY
    assert KEY not in json.dumps(asdict(config), default=str)
    monkeypatch.delenv("RLBENCH_SGLANG_API_KEY")
    monkeypatch.setenv("RLBENCH_SERVE_API_KEY", "left-over")
    assert "RLBENCH_SERVE_API_KEY" not in server_env(config)


def test_a_key_sglangs_own_servers_could_take_only_on_their_command_line_is_refused(tmp_path, monkeypatch):
    """SGLang's own server takes its key only as --api-key on its command line, which every user of the machine
    can read: with RLBENCH_SGLANG_API_KEY set, rlbench refuses to start such servers (exit 2, one line naming the
    ways that keep the key, the key itself nowhere), before it looks for the sglang package; without a key it
    goes on to that check (here: sglang is not installed)."""
    monkeypatch.setenv("RLBENCH_SGLANG_API_KEY", KEY)
    res = cli("run", "--rollout", "sglang", "--sglang-server", "sglang", "--steps", "1", "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "SGLang's own server takes its key only on its command line" in res.stderr and KEY not in res.stderr
    assert not (tmp_path / "r").exists()
    monkeypatch.delenv("RLBENCH_SGLANG_API_KEY")
    res = cli("run", "--rollout", "sglang", "--sglang-server", "sglang", "--steps", "1", "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "command line" not in res.stderr, res.stderr


def test_a_ray_server_actor_gets_the_key_as_an_argument_not_from_its_environment(monkeypatch):
    """Under `--placement ray` a server actor may run on a node without the driver's environment: the driver hands
    its key to the actor's `start` (here called in this process, with no key in the environment). The worker it
    starts listens on the node's address, beyond loopback, which it would refuse without a key; with the handed
    key it starts, and a request without the key gets 401, with it 200."""
    pytest.importorskip("ray")
    from rlbench.placement.ray_actors import ServerActor

    monkeypatch.delenv("RLBENCH_SGLANG_API_KEY", raising=False)
    config = load_config(rollout__backend="sglang", rollout__sglang_server="rlbench")
    actor = ServerActor()
    try:
        url = actor.start(json.dumps(config.to_dict()), 0, KEY)
        assert _call(url, "/get_model_info")[0] == 401
        assert _call(url, "/get_model_info", key=KEY)[0] == 200
    finally:
        actor.stop()


def test_a_keyed_run_through_the_router_to_a_keyed_worker_is_the_in_process_run(reference, tmp_path, monkeypatch):
    """`rlbench run --rollout sglang` with RLBENCH_SGLANG_API_KEY set: the `rlbench serve` worker it starts
    requires the key (a request without it, straight or through the router, gets 401 and changes nothing), the
    router passes the client's key on, and the run writes the in-process run's checksums.jsonl byte for byte. The
    key is on no command line, in no server log, in no file of the run directory and in nothing printed."""
    from rlbench.backends.sglang.engine import SGLangEngine

    monkeypatch.setenv("RLBENCH_SGLANG_API_KEY", KEY)
    update, seen = SGLangEngine.update_weights, {}

    def probed(self, weights, version):  # the run's first weight sync: its servers are up and keyed
        if not seen:
            generate = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
            for url in (*self.fleet.workers, self.fleet.router):
                seen[url] = [
                    _call(url, "/generate", generate),
                    _call(url, "/update_weights_from_disk", {"model_path": MODEL, "weight_version": "x"}),
                ]
            seen["commands"] = [Path(f"/proc/{p.popen.pid}/cmdline").read_bytes() for p in self.fleet.processes]
            seen["logs"] = [log.read_bytes() for log in self.fleet.logs.iterdir()]
        return update(self, weights, version)

    monkeypatch.setattr(SGLangEngine, "update_weights", probed)
    (tmp_path / "s.toml").write_text(small_toml(3))
    out = tmp_path / "keyed"
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
    )  # the default fleet: one server, behind a router
    assert res.returncode == 0, res.stderr
    assert (out / "checksums.jsonl").read_bytes() == (reference / "checksums.jsonl").read_bytes()

    manifest = json.loads((out / "manifest.json").read_text())
    workers = manifest["engines"]
    assert len(workers) == 1 and len(seen) == 1 + 1 + 2  # the worker and the router were asked
    for url in workers:
        assert seen[url] == [(401, {"error": "Unauthorized"})] * 2, url
    router = next(url for url in seen if url not in workers and url not in ("commands", "logs"))
    assert seen[router][0] == (401, {"error": "Unauthorized"})  # the router passes the worker's answer on
    assert len(seen["commands"]) == 2 and not any(KEY.encode() in c for c in seen["commands"] + seen["logs"])
    files = [path for path in out.rglob("*") if path.is_file()]
    assert len(files) > 5 and not [path for path in files if KEY.encode() in path.read_bytes()]
    assert KEY not in res.stdout + res.stderr


def test_a_run_without_the_key_against_a_keyed_server_stops_in_one_line(keyed, tmp_path, monkeypatch):
    """The other way: no RLBENCH_SGLANG_API_KEY, a server that needs one (behind the router the run starts):
    exit 2, one line saying the key is needed, nothing written."""
    monkeypatch.delenv("RLBENCH_SGLANG_API_KEY", raising=False)
    (tmp_path / "s.toml").write_text(small_toml(1))
    res = cli(
        "run",
        "-c",
        str(tmp_path / "s.toml"),
        "--rollout",
        "sglang",
        "--rollout-external-engine-addrs",
        keyed.url,
        "--out",
        str(tmp_path / "o"),
    )
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"rlbench: error: {keyed.url}/server_info: answered 401 Unauthorized: the fleet's api key "
        "(RLBENCH_SGLANG_API_KEY) is needed: set it"
    ], res.stderr
    assert not (tmp_path / "o").exists()
