"""`--placement ray`: the trainer's ranks and the rollout engines as Ray actors in one placement
group give the in-process run's checksums, bit for bit. A real local Ray instance (no dashboard,
`RAY_AUTH_MODE=disabled`, a private `RAY_TMPDIR`, shut down after) places `--trainer megatron --tp
2`: rank 0 in the trainer actor, rank 1 in an actor of its own, and a server actor (`rlbench
serve`) behind sglang-router; the run equals the in-process TP=2 run (rank processes), and leaves
no actor or process behind. The embedded-engine actor's path and the torch trainer's are held to
the same bits without Ray's processes (each actor taking ~10 s to import torch): their actor
classes are called in this process through the same proxies, so everything that crosses is packed
and unpacked as it is between processes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from rlbench.config import apply_overrides, load_config
from rlbench.session import run
from rlbench.rundir.directory import read_run
from tests.cpu.megatron_reference import TOML, reference_runs
from tests.cpu.test_megatron_parallel import wait_gone


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    from rlbench.placement.ray_connect import start_local

    tmp = tempfile.mkdtemp(prefix="rlray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    os.environ["RAY_TMPDIR"] = tmp
    # 3 logical CPUs (Ray's scheduling tokens, not cores): a bundle of one each for two trainer ranks and a server;
    # on 127.0.0.1, as rlbench starts Ray
    start_local(3, _temp_dir=tmp)
    try:
        yield ray
    finally:
        ray.shutdown()
        os.environ.pop("RAY_TMPDIR", None)
        shutil.rmtree(tmp, ignore_errors=True)


def _same_run(got: Path, want: Path) -> None:
    assert (got / "checksums.jsonl").read_bytes() == (want / "checksums.jsonl").read_bytes()
    strip = [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_run(got).metrics]
    assert strip == [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_run(want).metrics]


class _InProcess:
    """Placement without Ray: an "actor" is its class, instantiated here; a method's `.remote()` calls it."""

    def __init__(self, config, bundles):
        self.users, self.bundles, self.before_kill = 0, None, []

    def make_group(self, bundles):
        self.bundles = bundles

    def actor(self, cls, bundle, resources, *args):
        from types import SimpleNamespace

        instance = cls(*args)
        return SimpleNamespace(
            **{name: SimpleNamespace(remote=getattr(instance, name)) for name in dir(cls) if not name.startswith("_")}
        )

    def release(self):
        self.users -= 1

    def close(self):
        pass


def test_trainer_and_engine_actor_classes_give_the_in_process_run(small_config, reference, tmp_path, monkeypatch):
    from rlbench.placement import ray as placement

    monkeypatch.setattr(placement, "Placement", _InProcess)
    for proxy in (placement.RayTrainer, placement.RayEngine):
        monkeypatch.setattr(proxy, "_get", lambda self, ref: ref)
    out = tmp_path / "actors"
    run(apply_overrides(small_config, out=str(out), placement__backend="ray"))
    _same_run(out, reference)


def test_bundles_one_per_trainer_rank_then_one_per_engine_and_cpus_enough_for_them(small_config):
    from rlbench.errors import BadInput
    from rlbench.backends.registry import bundles as _shape
    from rlbench.placement.ray import local_cpus

    ray = {"placement__backend": "ray"}
    assert _shape(apply_overrides(small_config, **ray)) == (1, 1)
    megatron = apply_overrides(small_config, train__backend="megatron", tp=2, dp=2, **ray)
    assert _shape(megatron) == (4, 1)
    assert _shape(apply_overrides(megatron, rollout__backend="sglang", rollout__num_engines=3)) == (4, 3)
    assert _shape(apply_overrides(megatron, mode="rollout-only")) == (0, 1)
    assert local_cpus(apply_overrides(megatron, placement__num_cpus=5), 5) == 5  # cores shared on purpose
    with pytest.raises(BadInput, match=r"placement.num_cpus: expected at least 5 CPUs .* got 4: placement.num_cpus$"):
        local_cpus(apply_overrides(megatron, placement__num_cpus=4), 5)


def test_a_local_ray_instance_gets_the_cpus_of_this_machine_and_no_more(small_config, monkeypatch):
    from rlbench.backends import registry
    from rlbench.errors import BadInput
    from rlbench.placement.ray import local_cpus

    monkeypatch.setattr(registry, "available_cpus", lambda: 2)
    megatron = apply_overrides(small_config, train__backend="megatron", tp=2, placement__backend="ray")
    assert local_cpus(megatron, 2) == 2
    with pytest.raises(
        BadInput,
        match=r"^placement: expected at least 3 CPUs \(one for each trainer rank and each "
        r"engine\), got 2: this machine has 2 \(placement.num_cpus may say more\)$",
    ):
        local_cpus(megatron, 3)


# --------------------------------------------------------------------------- addresses and connecting


@pytest.mark.parametrize(
    "address, needle",
    [
        ("garbage", "got 'garbage' (no host name or IP address before :PORT)"),
        (
            "http://127.0.0.1:8265",
            "got the scheme 'http' (an http address is the dashboard's; the cluster's is HOST:6379)",
        ),
        ("127.0.0.1:0", "with a port in 1..65535, got '127.0.0.1:0'"),
        ("127.0.0.1:65536", "with a port in 1..65535"),
        ("ray://:10001", "no host name or IP address before :PORT"),
        ("::1:6379", "no host name or IP address before :PORT"),
        ("head:6379/path", "with a port in 1..65535"),
    ],
)
def test_a_ray_address_is_checked_before_anything_connects(tmp_path, address, needle):
    from tests.conftest import cli

    res = cli("run", "--placement", "ray", "--ray-address", address, "--out", str(tmp_path / "o"))
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("rlbench: error: placement.ray_address: expected auto, HOST:PORT") and needle in lines[0]


def test_the_timeout_is_a_ray_setting():
    from rlbench.errors import BadInput

    assert load_config(placement__backend="ray", placement__ray_timeout=5.0).placement.ray_timeout == 5.0
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(BadInput, match="placement.ray_timeout: expected a finite number in \\(0, 86,400\\]"):
            load_config(placement__backend="ray", placement__ray_timeout=bad)
    with pytest.raises(BadInput, match="placement.ray_timeout: expected the default unless placement.backend is ray"):
        load_config(placement__ray_timeout=5.0)


def test_a_ray_client_address_needs_the_client_extra(tmp_path, monkeypatch):
    import importlib.util

    from rlbench import extras
    from tests.conftest import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name, *a: None if name == "grpc" else real(name, *a))
    res = cli("run", "--placement", "ray", "--ray-address", "ray://127.0.0.1:10001", "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and res.stderr.splitlines() == [
        "rlbench: error: placement.ray_address: the grpc package is not installed here (a ray:// address is Ray's "
        "client: pip install 'ray[client]')"
    ], res.stderr


@pytest.fixture
def server():
    """A TCP server on 127.0.0.1 that answers every connection with `reply` (None: accepts and says nothing);
    yields a function that starts it and returns its port."""
    import socket
    import threading

    sockets = []

    def start(reply: bytes | None) -> int:
        listener = socket.create_server(("127.0.0.1", 0))
        sockets.append(listener)

        def serve():
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                sockets.append(conn)
                if reply is not None:
                    conn.recv(64)
                    conn.sendall(reply)
                    conn.close()

        threading.Thread(target=serve, daemon=True).start()
        return listener.getsockname()[1]

    yield start
    for sock in sockets:
        sock.close()


def _free_port() -> int:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("closed", "nothing listens there (connection refused)"),
        ("http", "the server there is not a Ray cluster (it does not speak gRPC)"),
        ("silent", "no answer within 1 s (--ray-timeout)"),
    ],
)
def test_an_address_where_no_ray_answers_is_one_line_within_the_timeout(tmp_path, monkeypatch, server, kind, needle):
    """Through `rlbench run`: refused at once (a closed port, a server of another kind) or after
    --ray-timeout (a server that never answers), never a hang; Ray itself is never asked."""
    import ray

    from tests.conftest import cli

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # whatever another test of this process started
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    http = b"HTTP/1.1 400 Bad Request\r\n\r\n"
    address = {
        "closed": lambda: f"127.0.0.1:{_free_port()}",
        "http": lambda: f"127.0.0.1:{server(http)}",
        "silent": lambda: f"127.0.0.1:{server(None)}",
    }[kind]()
    started = time.monotonic()
    res = cli(
        "run",
        "-c",
        str(_small(tmp_path)),
        "--placement",
        "ray",
        "--ray-address",
        address,
        "--ray-timeout",
        "1",
        "--out",
        str(tmp_path / "o"),
    )
    assert time.monotonic() - started < 60
    assert res.returncode == 2 and res.stderr.splitlines() == [
        f"rlbench: error: placement.ray_address: {address}: {needle}"
    ], res.stderr
    assert not (tmp_path / "o").exists()


def _small(tmp_path: Path) -> Path:
    from tests.conftest import small_toml

    (tmp_path / "s.toml").write_text(small_toml(1))
    return tmp_path / "s.toml"


def test_ray_that_does_not_connect_in_time_or_refuses_is_one_line(monkeypatch):
    """What is left of the timeout after the probe bounds ray.init itself (held here by an event, never a
    sleep), and Ray's own refusal is one line."""
    import threading

    import ray

    from rlbench.errors import BadInput
    from rlbench.placement.ray_connect import init_within

    release = threading.Event()
    monkeypatch.setattr(ray, "init", lambda *a, **k: release.wait())
    try:
        with pytest.raises(
            BadInput,
            match=r"^placement.ray_address: auto: Ray did not connect within 7 s "
            r"\(--ray-timeout\)$",
        ):
            init_within("auto", 0.2, 7)
    finally:
        release.set()

    def refuse(*a, **k):
        raise ConnectionError("Could not find any running Ray instance.\nPlease specify ...")

    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(
        BadInput,
        match=r"^placement.ray_address: auto: Ray refused the connection \(ConnectionError: "
        r"Could not find any running Ray instance.\)$",
    ):
        init_within("auto", 5, 5)


def test_a_failing_ray_run_is_one_line_and_leaves_no_directory_of_its_own(tmp_path, monkeypatch):
    """A Ray instance rlbench starts, as a user's shell has it (no RAY_AUTH_MODE: Ray's token authentication on,
    and its start-up warning about it), and a run that fails once its trainer actor is placed (the SGLang server
    it names does not answer): stderr is rlbench's one line, Ray's own warnings left out, and the temporary
    directory (the run's own TMPDIR) holds no rlbench-ray-checkpoint-* directory afterwards."""
    from rlbench.backends.sglang.fleet import free_port
    from tests.conftest import run_cli, small_toml

    tmp = Path(tempfile.mkdtemp(prefix="rlray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp))
    (tmp_path / "s.toml").write_text(small_toml(1).replace("[rollout]\n", "[rollout]\nrequest_attempts = 1\n"))
    closed = f"http://127.0.0.1:{free_port()}"
    try:
        res = run_cli(
            "run",
            "-c",
            str(tmp_path / "s.toml"),
            "--placement",
            "ray",
            "--rollout",
            "sglang",
            "--rollout-external-engine-addrs",
            closed,
            "--out",
            str(tmp_path / "o"),
            process=True,
        )
        assert res.returncode == 2 and res.stderr.splitlines() == [
            f"rlbench: error: /server_info failed once, the last: GET {closed}/server_info: ClientConnectorError: "
            f"Cannot connect to host 127.0.0.1:{closed.rsplit(':', 1)[1]} ssl:default [Connect call failed "
            f"('127.0.0.1', {closed.rsplit(':', 1)[1]})]"
        ], res.stderr
        assert sorted(p.name for p in tmp.glob("rlbench-*")) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_trainer_actor_removes_its_checkpoint_directory_before_the_placement_kills_it(
    small_config, tmp_path, monkeypatch
):
    """The trainer actor writes a checkpoint the driver hands it into a directory of its own, which must outlive
    the load (megatron's ranks read it when they start); Ray kills actors without running finalizers, so the
    placement has the actor remove it first, whether the run ended well or not."""
    from types import SimpleNamespace

    from rlbench.core.model import build_model, named_weights
    from rlbench.placement.ray import Placement
    from rlbench.placement.ray_actors import TrainerActor, pack

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = small_config
    model = build_model(config.model.path, config.seed, config.model.dtype, config.device, init=config.model.init)
    actor = TrainerActor(json.dumps(config.to_dict()), pack(named_weights(model)))
    actor.load_checkpoint(actor.save_checkpoint())
    assert [p.name[: len("rlbench-ray-checkpoint-")] for p in tmp_path.iterdir()] == ["rlbench-ray-checkpoint-"]
    placement = Placement.__new__(Placement)
    killed = []
    placement.ray = SimpleNamespace(wait=lambda refs, **_: (refs, []), kill=killed.append, shutdown=None)
    placement.actors, placement.group, placement.started_ray = ["trainer"], None, False
    placement.before_kill = [actor.remove_checkpoints]
    placement.close()
    assert killed == ["trainer"] and list(tmp_path.iterdir()) == []


def test_loopback_holds_only_while_ray_starts():
    from ray._private import ray_constants

    from rlbench.placement.ray_connect import LOOPBACK_ENV, loopback

    before = (os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER)
    with loopback():
        assert os.environ[LOOPBACK_ENV] == "0" and ray_constants.ENABLE_RAY_CLUSTER is False
        from ray._private.services import get_node_ip_address

        assert get_node_ip_address() == "127.0.0.1"  # the address Ray gives a new node (no node in this process)
    assert (os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER) == before


def test_a_cluster_too_small_for_the_bundles_is_refused_before_placing(monkeypatch):
    from types import SimpleNamespace

    from rlbench.errors import BadInput
    from rlbench.placement.ray import Placement

    placement = Placement.__new__(Placement)
    placement.ray = SimpleNamespace(cluster_resources=lambda: {"CPU": 2.0, "memory": 1e9})
    with pytest.raises(
        BadInput,
        match=r"^placement: the Ray cluster has 2 CPU in all, the run needs 3 \(one for each "
        r"trainer rank and engine: 3 bundles\)$",
    ):
        placement.make_group([{"CPU": 1}] * 3)
    with pytest.raises(BadInput, match="has 0 GPU in all, the run needs 2"):
        placement.make_group([{"CPU": 1, "GPU": 1}] * 2)


def test_an_rlbench_error_inside_an_actor_comes_back_as_itself(monkeypatch):
    import ray

    from rlbench.errors import BadInput
    from rlbench.placement.ray import get

    cause = BadInput("not a checkpoint (no state.json)", path="/x")
    monkeypatch.setattr(
        ray,
        "get",
        lambda ref: (_ for _ in ()).throw(
            ray.exceptions.RayTaskError("load_checkpoint", "Traceback ...\nmany lines", cause)
        ),
    )
    with pytest.raises(BadInput) as info:
        get(object(), lambda why: AssertionError(why))
    assert info.value is cause and str(info.value) == "/x: not a checkpoint (no state.json)"


def _actors() -> list[dict]:
    """Ray's actor table, read from its GCS (the public state API, ray.util.state, needs the dashboard)."""
    from ray._private import state

    return list(state.actors().values())


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _instance_processes_running_rlbench() -> list[int]:
    """Processes of the test's Ray instance (its RAY_TMPDIR in their environment) whose command names rlbench."""
    tag = f"RAY_TMPDIR={os.environ['RAY_TMPDIR']}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and tag in (entry / "environ").read_bytes().split(b"\0")
                and b"rlbench" in (entry / "cmdline").read_bytes()
            ):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.slow  # actors importing megatron-core; the reference run's rank processes (megatron_reference.py)
def test_megatron_ranks_and_servers_as_actors_give_the_in_process_tp2_run(
    ray_instance, tmp_path_factory, worker_id, tmp_path, monkeypatch
):
    from rlbench.placement import ray as placement

    during = {}
    train_step = placement.RayTrainer.train_step

    def watched(self, batch, step):  # what runs while the run does
        during.setdefault("actors", [a for a in _actors() if a["State"] == "ALIVE"])
        during.setdefault("groups", list(ray_instance.util.placement_group_table().values()))
        during.setdefault("running", [_running(a["Pid"]) for a in during["actors"]])  # the check below sees them
        return train_step(self, batch, step)

    monkeypatch.setattr(placement.RayTrainer, "train_step", watched)
    (tmp_path / "s.toml").write_text(TOML)
    out = tmp_path / "ray-tp2"
    run(
        apply_overrides(
            load_config(tmp_path / "s.toml"),
            steps=2,
            tp=2,
            out=str(out),
            placement__backend="ray",
            rollout__backend="sglang",
            rollout__sglang_server="rlbench",
        )
    )

    # slime's shape: trainer bundles first, one per rank, then one per engine; rank 1 an actor rank 0 owns
    [group] = during["groups"]
    assert (group["strategy"], len(group["bundles"])) == ("PACK", 3)
    by_class = {a["ActorClassName"]: a for a in during["actors"]}
    assert sorted(a["ActorClassName"] for a in during["actors"]) == ["RankActor", "ServerActor", "TrainerActor"]
    assert by_class["RankActor"]["OwnerAddress"] == by_class["TrainerActor"]["Address"]
    assert during["running"] == [True] * 3

    # The in-process TP=2 run of this config (10 steps; a step's bits do not depend on the step count):
    # asked for after the run, so that another worker making it meanwhile costs no wall time here.
    reference = reference_runs(tmp_path_factory, worker_id)
    lines = (out / "checksums.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    assert lines == (reference / "tp2" / "checksums.jsonl").read_bytes().splitlines(keepends=True)[:2]
    assert lines[0] != (reference / "tp1" / "checksums.jsonl").read_bytes().splitlines(keepends=True)[0]
    strip = [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_run(out).metrics]
    assert strip == [
        {k: v for k, v in row.items() if not k.startswith("perf/")} for row in read_run(reference / "tp2").metrics[:2]
    ]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["placement"]["backend"] == "ray" and manifest["versions"]["ray"]
    assert (manifest["config"]["tp"], len(manifest["engines"])) == (2, 1)

    # on 127.0.0.1: the instance, and what the actors told the driver (the server's URL, reached through it)
    assert ray_instance.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert ray_instance.util.get_node_ip_address() == "127.0.0.1"
    assert all("127.0.0.1" in json.dumps(engine) for engine in manifest["engines"]), manifest["engines"]

    # nothing left: every actor dead and its process gone, no server process, the group removed
    assert ray_instance.is_initialized()  # rlbench left running the instance it did not start
    assert all(g["state"] == "REMOVED" for g in ray_instance.util.placement_group_table().values())
    wait_gone([a["Pid"] for a in during["actors"]] + _instance_processes_running_rlbench())
    assert [a["ActorClassName"] for a in _actors() if a["State"] != "DEAD"] == []
    assert [a["ActorClassName"] for a in during["actors"] if _running(a["Pid"])] == []
    assert _instance_processes_running_rlbench() == []


@pytest.mark.slow  # actors importing megatron-core, twice (the run and its resume)
def test_a_rank_actor_killed_by_signal_stops_the_run_in_one_line_and_resume_finishes_it(
    ray_instance, tmp_path_factory, worker_id, tmp_path, monkeypatch
):
    """`--placement ray --trainer megatron --tp 2`: as step 1 is about to train, the driver SIGKILLs rank 1's
    actor process (its PID from Ray's actor table) and waits for it to be gone. The trainer actor names the dead
    rank; the run stops with exit 2 and one line, step 0 committed and readable, no actor left; `--resume` (Ray
    again) ends with the in-process TP=2 run's files for those steps."""
    import signal

    from rlbench.placement import ray as placement
    from tests.conftest import cli

    train_step, killed = placement.RayTrainer.train_step, []

    def kill_rank_1(self, batch, step):
        if step == 1 and not killed:
            [rank_1] = [a for a in _actors() if a["ActorClassName"] == "RankActor" and a["State"] == "ALIVE"]
            os.kill(rank_1["Pid"], signal.SIGKILL)
            wait_gone([rank_1["Pid"]])
            killed.append(rank_1["Pid"])
        return train_step(self, batch, step)

    monkeypatch.setattr(placement.RayTrainer, "train_step", kill_rank_1)
    (tmp_path / "s.toml").write_text(TOML)
    out = tmp_path / "ray-tp2"
    res = cli(
        "run", "-c", str(tmp_path / "s.toml"), "--steps", "2", "--tp", "2", "--placement", "ray", "--out", str(out)
    )
    assert killed and res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == [
        "rlbench: error: megatron rank 1 of 2 was killed (SIGKILL) while running the logprobs command; the run "
        "stopped (its committed steps are kept: rlbench run --resume RUN continues it)"
    ], res.stderr
    assert read_run(out).steps == [0]
    assert all(g["state"] == "REMOVED" for g in ray_instance.util.placement_group_table().values())
    assert [a["ActorClassName"] for a in _actors() if a["State"] != "DEAD"] == []

    monkeypatch.setattr(placement.RayTrainer, "train_step", train_step)
    res = cli("run", "--resume", str(out), "--json")
    assert res.returncode == 0, res.stderr
    reference = reference_runs(tmp_path_factory, worker_id)  # the in-process TP=2 run (10 steps of this config)
    assert (out / "checksums.jsonl").read_bytes().splitlines() == (
        reference / "tp2" / "checksums.jsonl"
    ).read_bytes().splitlines()[:2]
    assert [a["ActorClassName"] for a in _actors() if a["State"] != "DEAD"] == []
