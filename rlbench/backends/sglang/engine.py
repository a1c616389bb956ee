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
- update_weights: the trainer's export as a Hugging Face-format directory (model.safetensors and
  the model's config.json; the previous version's directory is removed), then on every server
  POST /update_weights_from_disk {"model_path", "weight_version"} and /flush_cache.
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

import torch

from rlbench.backends.sglang import wire
from rlbench.backends.sglang.client import Client, Retryable
from rlbench.backends.sglang.wire import BadAnswer
from rlbench.backends.sglang.fleet import (Fleet, answers, launch_server, make_logs, registered, start_router,
                                           wait_server)
from rlbench.core.types import GenerateRequest, GenerateResult
from rlbench.errors import BadInput, EngineUnavailable, WeightMismatch
from rlbench.rundir.digest import tensor_digests


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
                    await self._drop_dead()
                if attempt + 1 < self.attempts:
                    await asyncio.sleep(min(0.25 * 2 ** attempt, 4.0))
                continue
            if self.version is not None and answer.weight_version != self.version:
                raise WeightMismatch(f"{url} answered with weight version {answer.weight_version!r}; the run pushed "
                                     f"{self.version!r} to every server (a server that missed the update?)")
            results[index] = GenerateResult(answer.output_ids, answer.logprobs, answer.finish_reason, self.engine_id,
                                            int(self.version) if self.version is not None else 0)
            return
        raise EngineUnavailable(f"/generate failed {self.attempts} times, the last: {last}")

    async def _drop_dead(self) -> None:
        """Ask every server whether it still answers; drop the dead ones (from the router too). When
        none is left, stop: EngineUnavailable. One probe at a time; concurrent failures share it."""
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
                raise EngineUnavailable(f"no SGLang server answers: {', '.join(dead)} "
                                        f"{'is' if len(dead) == 1 else 'are'} gone")

    async def _unregister(self, dead: list[str]) -> None:
        router = self.fleet.router
        try:
            listed = (await self.client.ok("GET", f"{router}/workers", timeout_s=10)).get("workers", [])
            for worker in listed:
                if worker.get("url") in dead:
                    await self.client.call("DELETE", f"{router}/workers/{worker['id']}", timeout_s=10)
        except (Retryable, BadInput, AttributeError):
            pass  # the router keeps trying it and its retries go elsewhere; the answers are checked anyway

    # ---- weights ------------------------------------------------------------------------------

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        path = self._write(weights, version)
        self.client.run(self._push(path, str(version)))
        self.version = str(version)
        self._pushed = weights
        for old in self.weights_dir.glob("weight_v*"):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)

    def _write(self, weights: Mapping[str, torch.Tensor], version: int) -> Path:
        """A Hugging Face-format directory: model.safetensors and the model's config.json."""
        from safetensors.torch import save_file

        path = self.weights_dir / f"weight_v{version:06d}"
        partial = self.weights_dir / f".{path.name}.tmp"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(partial / "model.safetensors"),
                  metadata={"format": "pt"})
        shutil.copyfile(Path(self.config.model.path) / "config.json", partial / "config.json")
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)
        return path

    async def _push(self, path: Path, version: str) -> None:
        await self._each("POST", "/update_weights_from_disk", {"model_path": str(path), "weight_version": version})
        await self._each("POST", "/flush_cache", None)

    async def _each(self, method: str, path: str, body) -> list:
        """Call every live server; a dead one is dropped (EngineUnavailable when none is left)."""
        async def one(url: str):
            for attempt in range(self.attempts):
                try:
                    data = await self.client.ok(method, f"{url}{path}", body)
                except Retryable as exc:
                    if exc.unreachable:
                        return None
                    await asyncio.sleep(min(0.25 * 2 ** attempt, 4.0))
                    continue
                if isinstance(data, dict) and data.get("success") is False:
                    raise BadInput(f"refused: {data.get('message')}", path=f"{url}{path}")
                return data
            raise EngineUnavailable(f"{url}{path} failed {self.attempts} times")

        replies = await asyncio.gather(*(one(url) for url in self.fleet.workers))
        if any(reply is None for reply in replies):
            await self._drop_dead()
        return [reply for reply in replies if reply is not None]

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
            source = f"{url}/weights_checker"
            try:
                got = wire.parse_checksums(await self.client.ok("POST", source, {"action": "checksum"}), source)
            except ValueError as exc:
                raise BadInput(f"not SGLang's /weights_checker answer: {exc}", path=source) from None
            self._comparable(url, got, want)
            out[url] = {name: digests[name] if got.checksums[name] == want[name] else f"sglang:{got.checksums[name]}"
                        for name in want}
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
            why = (f"it reports its own tensor layout ({len(common)} of the trainer's {len(want)} names in common; "
                   f"only the server's: {sorted(set(got.checksums) - set(want))[:3]}, only the trainer's: "
                   f"{sorted(set(want) - set(got.checksums))[:3]})"
                   + (f"; of those in common, {len(differ)} differ, the first {differ[0]}" if differ else ""))
        if why is not None:
            raise BadInput(f"the trainer's weights cannot be compared with this server's: {why}; set "
                           "rollout.verify_engine_weights = false to run without the weight-update check",
                           path=f"{url}/weights_checker")

    def export_weights(self, holder: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        async def fetch(name: str) -> torch.Tensor:
            source = f"{holder}/get_weights_by_name"
            values = await self.client.ok("POST", source, {"name": name, "truncate_size": 2**31 - 1})
            try:
                return torch.tensor(values, dtype=torch.float32).to(self.dtype)
            except (TypeError, ValueError, RuntimeError, OverflowError):
                raise BadInput(f"expected the values of {name} as a (nested) list of numbers, got {str(values)[:80]}",
                               path=source) from None

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
            fleet.workers = sorted(client.run(registered(client, router)))
            if not fleet.workers:
                raise EngineUnavailable(f"sglang-router {router} lists no healthy server (GET /workers)")
        else:
            if rollout.external_engine_addrs:
                fleet.workers = [wire.normalize_url(a) for a in rollout.external_engine_addrs]
            elif start_servers is not None:
                start_servers(fleet, client)
            else:
                procs = [launch_server(config, fleet.logs, i) for i in range(rollout.num_engines)]
                fleet.processes.extend(procs)
                fleet.workers = [wait_server(p, lambda url: client.run(answers(client, url))) for p in procs]
            if rollout.use_router:
                start_router(fleet, lambda url: client.run(registered(client, url)))
            else:
                fleet.route = list(fleet.workers)
        engine.server_info = client.run(_server_info(client, fleet.workers))
    except BaseException:
        engine.close()
        raise
    return engine


def _vocab(model_path: str) -> int:
    """The model's vocabulary (its config's vocab_size): every sampled id must be inside it."""
    from rlbench.core.model import load_model_config

    return int(load_model_config(model_path).vocab_size)


async def _server_info(client: Client, workers: list[str]) -> dict[str, dict]:
    """Each server's /server_info (for the manifest); a server that does not answer is EngineUnavailable."""
    async def one(url: str) -> dict:
        try:
            return await client.ok("GET", f"{url}/server_info", timeout_s=30)
        except Retryable as exc:
            raise EngineUnavailable(f"SGLang server {url} does not answer: {exc}") from None

    replies = await asyncio.gather(*(one(url) for url in workers))
    return dict(zip(workers, replies))
