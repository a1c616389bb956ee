"""The `sglang` RolloutEngine: rollouts and weight syncs over SGLang's native HTTP API.

- generate: one /generate per request (slime does the same: a request carries its own
  `sampling_seed`, and the router refuses a list of sampling params), all in flight together up to
  `rollout.max_inflight`, through the router (or spread over the servers). Every answer is held to
  its request before anything of it is kept (wire.parse_answer: ids inside the model's vocabulary,
  log-probs finite and <= 0, no more tokens than asked, a finish reason that agrees with them); an
  aborted answer is never kept. A failed attempt (no connection, a timeout, 408/429/5xx, an abort, an
  answer that fails those checks) is sent again, to the next server where the client spreads them,
  else to the router, which picks a live one; since its seed travels with it, its tokens and
  log-probs are the same whichever server answers. A failed attempt first asks which servers still
  answer: a dead one is dropped (and removed from the router). When every attempt failed, or no
  server is left, the run stops with EngineUnavailable (exit 2, the last failure naming the server
  and the field) before anything of the step is recorded.
- Every answer must carry the weight version the run pushed last: a server that missed an update
  (restarted, say) stops the run (WeightMismatch) instead of sampling from stale weights.
- Every other endpoint the client calls fails the same way (`_call`): /server_info (the first call to
  each server), /update_weights_from_disk, /flush_cache, /weights_checker, /get_weights_by_name and a
  router's GET /workers are each safe to repeat, so a 408/429/5xx, a dropped connection or a garbled
  answer (wire.py holds each to its shape) is tried again, then the run stops with EngineUnavailable
  (exit 2, one line: the server, the endpoint, the last answer); a server gone altogether is dropped as
  for /generate. A 4xx is the server refusing: exit 2 at once. /model_info (is it alive?) and
  /health_generate (has a server rlbench started come up?) are probes, whose failure is an answer.
- update_weights: the trainer's export as a Hugging Face-format directory (model.safetensors and
  the model's config.json; the previous version's directory is removed), then on every server
  POST /update_weights_from_disk {"model_path", "weight_version"} and /flush_cache. With
  `rollout.update_weight_mode = "delta"`, slime's delta sync instead: each sync a version of slime's chain
  (core/weight_delta.py), POST /pull_weights on every server (slime's SGLang patch: the host-local checkpoint
  brought to it, verified), then the same reload of that checkpoint.
- weight_checksums: SGLang's /weights_checker {"action": "checksum"} on every server (its 0.5.23
  answer: per rank, each tensor's hash), compared with the same hash of what the trainer pushed: a
  tensor whose hash agrees is reported as the trainer's digest (rundir/digest.py's, what the
  weight-update check compares), one that differs as the server's hash, so the check
  (core/weight_check.py) fetches it with /get_weights_by_name and names the element. The hash is
  SGLang's, not rlbench's run-directory checksum, so a server of another rlbench version hashes alike.
  What cannot be compared is said, and stops the run (exit 2): a server sharded over several ranks,
  one hashing on a GPU (SGLang's kernel there is not the CPU's sha256), one reporting its own fused
  layout (qkv_proj, gate_up_proj) instead of the trainer's names. `rlbench serve` hashes on the
  CPU under Hugging Face names, so the check holds it; against SGLang's own server on a GPU, set
  `rollout.verify_engine_weights = false`, and the sync is held to each server's success answer and,
  on every later answer, to its weight version.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlbench.backends.sglang import wire
from rlbench.backends.sglang.client import Client, Retryable
from rlbench.backends.sglang.wire import BadAnswer
from rlbench.backends.sglang.fleet import (
    Fleet,
    launch_server,
    make_logs,
    not_ready,
    registered,
    start_router,
    wait_server,
)
from rlbench.core.types import GenerateRequest, GenerateResult
from rlbench.errors import BadInput, EngineUnavailable, WeightMismatch
from rlbench.rundir.digest import tensor_digests

BACKOFF_S = 0.25  # the wait before a request's second attempt, doubled before each next one (at most 4 s)


def backoff(attempt: int) -> float:
    """Seconds to wait after failed attempt number `attempt` (0-based)."""
    return min(BACKOFF_S * 2**attempt, 4.0)


class _Gone(Exception):
    """A server that no longer answers at all (its connection refused or dropped, its /model_info too):
    dropped from the fleet rather than retried."""


def _as_is(data: Any, _source: str) -> Any:
    """An answer whose body says nothing more than its 2xx status (SGLang's /flush_cache answers text)."""
    return data


def _loaded(data: Any, source: str) -> dict:
    """/update_weights_from_disk's answer: `success: true`; `false` is the server refusing the update (BadInput,
    its message quoted), an answer of another shape a failed attempt (ValueError)."""
    answer = wire.parse_update(data, source)
    if not answer["success"]:
        raise BadInput(f"refused: {answer.get('message')}", path=source.split(" ", 1)[-1])
    return answer


class SGLangEngine:
    def __init__(self, config, fleet: Fleet, client: Client):
        rollout = config.rollout
        self.config, self.fleet, self.client = config, fleet, client
        self.attempts, self.verify = rollout.request_attempts, rollout.verify_engine_weights
        self.dtype = getattr(torch, config.model.dtype)
        self.engine_id = "sglang"
        self.version: str | None = None  # the weight version pushed last
        self._owned_weights = rollout.weights_dir is None
        self.weights_dir = Path(rollout.weights_dir or tempfile.mkdtemp(prefix="rlbench-weights-"))
        self._probe_lock: asyncio.Lock | None = None
        self.server_info: dict[str, dict] = {}
        self.vocab = _vocab(config.model.path)
        self._pushed: Mapping[str, torch.Tensor] | None = None  # the weights pushed last, for the checksums
        self.publisher = None  # slime's delta sync (update_weight_mode delta): the trainer's side
        self.sync_version = 0  # the chain's version pushed last (slime counts syncs; the run's version travels apart)
        self.wire_bytes: int | None = None  # bytes written for the last sync

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return self.client.run(self._generate(requests))

    async def _generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        results: list[GenerateResult | None] = [None] * len(requests)
        try:
            async with asyncio.TaskGroup() as group:
                for index, request in enumerate(requests):
                    group.create_task(self._one(index, request, results))
        except* Exception as failures:  # the first failure stands for the step; the other tasks were cancelled
            raise failures.exceptions[0] from None
        return results

    async def _one(self, index: int, request: GenerateRequest, results: list) -> None:
        body, last = wire.request_body(request), None
        for attempt in range(self.attempts):
            url = self.fleet.route[(index + attempt) % len(self.fleet.route)] + "/generate"
            try:
                answer = wire.parse_answer(await self.client.ok("POST", url, body), url, request, self.vocab)
            except (Retryable, BadAnswer) as exc:
                last = exc
                if isinstance(exc, Retryable):
                    await self._drop_dead(exc)
                if attempt + 1 < self.attempts:
                    await asyncio.sleep(backoff(attempt))
                continue
            if self.version is not None and answer.weight_version != self.version:
                raise WeightMismatch(
                    f"{url} answered with weight version {answer.weight_version!r}; the run pushed "
                    f"{self.version!r} to every server (a server that missed the update?)"
                )
            results[index] = GenerateResult(
                answer.output_ids,
                answer.logprobs,
                answer.finish_reason,
                self.engine_id,
                int(self.version) if self.version is not None else 0,
            )
            return
        raise EngineUnavailable(f"/generate failed {self._times()}, the last: {last}")

    async def _drop_dead(self, cause: Exception | None = None) -> None:
        """Ask every server whether it still answers; drop the dead ones (from the router too). When
        none is left, stop: EngineUnavailable, quoting `cause` (the failure that made the client ask).
        One probe at a time; concurrent failures share it."""
        if self._probe_lock is None:
            self._probe_lock = asyncio.Lock()
        async with self._probe_lock:
            alive = await asyncio.gather(*(self.client.alive(url) for url in self.fleet.workers))
            dead = [url for url, ok in zip(self.fleet.workers, alive) if not ok]
            if not dead:
                return
            self.fleet.workers = [url for url in self.fleet.workers if url not in dead]
            if self.fleet.router is None:
                self.fleet.route = list(self.fleet.workers)
            else:
                await self._unregister(dead)
            if not self.fleet.workers:
                said = f" (the last failure: {cause})" if cause is not None else ""
                raise EngineUnavailable(
                    f"no SGLang server answers: {', '.join(dead)} {'is' if len(dead) == 1 else 'are'} gone{said}"
                )

    async def _unregister(self, dead: list[str]) -> None:
        """Remove the dead servers from the router (GET /workers, DELETE /workers/{id}), as best it can."""
        router = self.fleet.router
        try:
            listed = wire.parse_workers(
                await self.client.ok("GET", f"{router}/workers", timeout_s=10), f"GET {router}/workers"
            )
            for worker in listed:
                if worker["url"] in dead and isinstance(worker.get("id"), str):
                    await self.client.call("DELETE", f"{router}/workers/{worker['id']}", timeout_s=10)
        except (Retryable, BadInput, ValueError):
            pass  # the router keeps trying it and its retries go elsewhere; the answers are checked anyway

    async def _call(
        self,
        method: str,
        server: str,
        endpoint: str,
        body: Any = None,
        read: Callable[[Any, str], Any] = _as_is,
        timeout_s: float | None = None,
        gone: bool = False,
    ) -> Any:
        """`method server+endpoint`, attempted as a /generate is (each call here is safe to repeat: a load of
        the same path and version, a flush, a read): a failure another attempt may mend (no connection, a
        timeout, 408, 429, 5xx) or an answer `read(answer, source)` refuses (ValueError naming the source
        and the field: garbled, or not of SGLang's shape) is tried again after a backoff; once the attempts
        are spent, EngineUnavailable (exit 2) naming the server, the endpoint and the last answer. A 4xx is
        the server refusing: BadInput at once (Client.ok). `gone`: a server that no longer answers at all
        (connection refused or dropped, /model_info neither) is `_Gone` at once, for the caller to drop."""
        url, last = f"{server}{endpoint}", None
        for attempt in range(self.attempts):
            try:
                return read(await self.client.ok(method, url, body, timeout_s), f"{method} {url}")
            except Retryable as exc:
                if gone and exc.unreachable and not await self.client.alive(server):
                    raise _Gone(exc) from None
                last = exc
            except ValueError as exc:
                last = exc
            if attempt + 1 < self.attempts:
                await asyncio.sleep(backoff(attempt))
        raise EngineUnavailable(f"{endpoint} failed {self._times()}, the last: {last}")

    def _times(self) -> str:
        return "once" if self.attempts == 1 else f"{self.attempts} times"

    # ---- weights ------------------------------------------------------------------------------

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        if self.config.rollout.update_weight_mode == "delta":
            self.client.run(self._push(self._publish(weights), str(version)))
            self.version, self._pushed = str(version), weights
            return
        path = self._write(weights, version)
        self.client.run(self._push(path, str(version)))
        self.version = str(version)
        self._pushed = weights
        self.wire_bytes = sum(f.stat().st_size for f in path.iterdir())
        for old in self.weights_dir.glob("weight_v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    def _publish(self, weights: Mapping[str, torch.Tensor]) -> Path:
        """slime's delta sync (core/weight_delta.py): the first sync a full version 1 (the chain's start; a new chain
        each run: earlier versions and the local checkpoint cleared), every later one a delta on the one before;
        every server pulls it into the host-local checkpoint (/pull_weights, verified there), which is returned for
        the ordinary reload."""
        from rlbench.core.weight_delta import Publisher

        rollout = self.config.rollout
        local = Path(rollout.local_checkpoint_dir or self.weights_dir / "local")
        if self.publisher is None:
            for old in self.weights_dir.glob("weight_v*"):
                shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)
            self.publisher = Publisher(
                self.weights_dir, rollout.update_weight_delta_encoding, rollout.update_weight_delta_checksum
            )
            self.sync_version = 1
            done = self.publisher.publish_full(1, dict(weights), Path(self.config.model.path) / "config.json")
        else:
            self.sync_version += 1
            done = self.publisher.publish(self.sync_version, dict(weights))
        self.wire_bytes = done.wire_bytes
        body = {"local_checkpoint_dir": str(local), "source_dir": str(self.weights_dir), "target_version": done.version}
        self.client.run(self._each("POST", "/pull_weights", body, _loaded))  # {success, message}: the same judging
        return local

    def _write(self, weights: Mapping[str, torch.Tensor], version: int) -> Path:
        """A Hugging Face-format directory: model.safetensors and the model's config.json."""
        from rlbench.core.weight_delta import write_hf_directory

        path = self.weights_dir / f"weight_v{version:06d}"
        config = Path(self.config.model.path) / "config.json"
        return write_hf_directory(path, dict(weights), config, metadata={"format": "pt"})

    async def _push(self, path: Path, version: str) -> None:
        await self._each(
            "POST", "/update_weights_from_disk", {"model_path": str(path), "weight_version": version}, _loaded
        )
        await self._each("POST", "/flush_cache", None)

    async def _each(self, method: str, endpoint: str, body, read: Callable[[Any, str], Any] = _as_is) -> None:
        """`_call` every live server; one that no longer answers at all is dropped (EngineUnavailable when
        none is left)."""
        gone: list[_Gone] = []

        async def one(server: str) -> None:
            try:
                await self._call(method, server, endpoint, body, read, gone=True)
            except _Gone as exc:
                gone.append(exc)

        await asyncio.gather(*(one(server) for server in self.fleet.workers))
        if gone:
            await self._drop_dead(gone[0])

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        if not self.verify:
            return {}
        if self._pushed is None:
            raise RuntimeError("weight_checksums before any update_weights: nothing to compare with")
        return self.client.run(self._checksums(self._pushed))

    async def _checksums(self, pushed: Mapping[str, torch.Tensor]) -> dict[str, dict[str, str]]:
        """Per server: each pushed tensor's digest where the server's hash of it agrees with the hash of
        what was pushed, else "sglang:<its hash>" (a difference check_engine then locates)."""
        want = {name: wire.tensor_hash(tensor) for name, tensor in pushed.items()}
        digests = tensor_digests(pushed)
        out = {}
        for url in list(self.fleet.workers):
            got = await self._call("POST", url, "/weights_checker", {"action": "checksum"}, wire.parse_checksums)
            self._comparable(url, got, want)
            out[url] = {
                name: digests[name] if got.checksums[name] == want[name] else f"sglang:{got.checksums[name]}"
                for name in want
            }
        return out

    def _comparable(self, url: str, got: wire.Checksums, want: dict[str, str]) -> None:
        """BadInput, saying why, when this server's hashes cannot be compared with the trainer's tensors."""
        info = self.server_info.get(url)
        info = info if isinstance(info, dict) else {}
        why = None
        if got.ranks > 1:
            why = f"its weights are sharded over {got.ranks} ranks, each hashed alone"
        elif info.get("server") != "rlbench serve" and info.get("device") != "cpu":
            why = f"it hashes on {info.get('device', 'a GPU')} with a kernel of its own, not the CPU's sha256"
        elif set(got.checksums) != set(want):
            common = [n for n in want if n in got.checksums]
            differ = [n for n in common if got.checksums[n] != want[n]]
            why = (
                f"it reports its own tensor layout ({len(common)} of the trainer's {len(want)} names in common; "
                f"only the server's: {sorted(set(got.checksums) - set(want))[:3]}, only the trainer's: "
                f"{sorted(set(want) - set(got.checksums))[:3]})"
                + (f"; of those in common, {len(differ)} differ, the first {differ[0]}" if differ else "")
            )
        if why is not None:
            raise BadInput(
                f"the trainer's weights cannot be compared with this server's: {why}; set "
                "rollout.verify_engine_weights = false to run without the weight-update check",
                path=f"{url}/weights_checker",
            )

    async def server_infos(self) -> dict[str, dict]:
        """Each server's /server_info (its arguments, for the manifest): the run's first call to each server,
        so one that never answers, or not as SGLang, stops the run here (EngineUnavailable) before set-up."""

        def info(data: Any, source: str) -> dict:
            return wire.parse_object(data, source, "the server's arguments")

        workers = list(self.fleet.workers)
        replies = await asyncio.gather(
            *(self._call("GET", url, "/server_info", read=info, timeout_s=30) for url in workers)
        )
        return dict(zip(workers, replies))

    def export_weights(self, holder: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        def values(data: Any, source: str) -> torch.Tensor:
            try:
                return torch.tensor(data, dtype=torch.float32).to(self.dtype)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                raise ValueError(
                    f"{source}: (answer): expected the values of the tensor as a (nested) list of "
                    f"numbers, got {str(data)[:80]}"
                ) from None

        async def fetch(name: str) -> torch.Tensor:
            return await self._call(
                "POST", holder, "/get_weights_by_name", {"name": name, "truncate_size": 2**31 - 1}, values
            )

        async def all_of() -> dict[str, torch.Tensor]:
            return {name: await fetch(name) for name in names}

        return self.client.run(all_of())

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.fleet.close()
            if self._owned_weights:
                shutil.rmtree(self.weights_dir, ignore_errors=True)


def open_engine(config, start_servers: Callable[[Fleet, Client], None] | None = None) -> SGLangEngine:
    """The engine over the servers `config.rollout` names (fleet.py), started where rlbench owns them;
    `start_servers(fleet, client)` starts them some other way (Ray actors). Whatever was started
    before a failure is stopped again."""
    rollout = config.rollout
    client = Client(rollout.max_inflight, rollout.request_timeout)
    fleet = Fleet(route=[], workers=[], logs=make_logs())
    engine = SGLangEngine(config, fleet, client)
    try:
        if rollout.sglang_router_url:
            router = wire.normalize_url(rollout.sglang_router_url, "rollout.sglang_router_url")
            fleet.router, fleet.route = router, [router]
            listed = client.run(engine._call("GET", router, "/workers", read=wire.parse_workers, timeout_s=10))
            fleet.workers = sorted(wire.healthy(listed))
            if not fleet.workers:
                raise EngineUnavailable(f"sglang-router {router} lists no healthy server (GET /workers)")
            engine.server_info = client.run(engine.server_infos())
        else:
            if rollout.external_engine_addrs:
                fleet.workers = [wire.normalize_url(a) for a in rollout.external_engine_addrs]
            elif start_servers is not None:
                start_servers(fleet, client)
            else:
                procs = [launch_server(config, fleet.logs, i) for i in range(rollout.num_engines)]
                fleet.processes.extend(procs)
                fleet.workers = [wait_server(p, lambda url: client.run(not_ready(client, url))) for p in procs]
            # before a router goes in front: a server that does not answer is named now, not after the router's wait
            engine.server_info = client.run(engine.server_infos())
            if rollout.use_router:
                start_router(fleet, lambda url: client.run(registered(client, url)))
            else:
                fleet.route = list(fleet.workers)
    except BaseException:
        engine.close()
        raise
    return engine


def _vocab(model_path: str) -> int:
    """The model's vocabulary (core/vocab.py: its config's vocab_size): every sampled id must be inside it,
    padded ids (those the tokenizer has no text for) included, as SGLang samples them."""
    from rlbench.core.vocab import model_vocab

    return model_vocab(model_path)
