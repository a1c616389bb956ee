"""The scheduler of `rlbench serve`: one engine thread, requests decoded token by token in batches
that take turns, and the control requests of SGLang's scheduler (abort, pause, continue).

- Every engine call (a decode step, a weight load, a checksum) runs on one thread. Requests that
  wait together start as one engine batch (`HFEngine.steps`): when the engine is idle the worker
  gathers them for `gather_s` more seconds while they keep arriving (up to `max_rows`). Batches
  advance one token each in turn, so a request that arrives while a long one decodes starts at the
  next token, not after it (a slow request never stalls the others). The embedded engine is
  batch-invariant, so neither the grouping nor the turns change a request's tokens or log-probs.
- A request finishes as soon as its own row does (its stop token, its length, a stop string the
  worker finds in its text, an abort), whatever its batch still decodes.
- Weight loads wait for the requests that came before them and hold back those after them (SGLang's
  model-update lock), unless generation is paused, when they run at once (SGLang takes no lock then).
  Reads of the weights (checksums, /get_weights_by_name) run between two tokens.
- `abort(rid, abort_all)`: a waiting request ends with no tokens ("Abort in waiting queue"), a
  running one with what it has ("Aborted"), as SGLang's scheduler answers. `pause(mode)`: "abort"
  aborts everything; "in_place" stops decoding where it is; "retract" puts the running requests
  back in the queue, to be decoded again from their prompt on `resume()` (the same tokens: their
  seeds travel with them), each counting a retraction. While paused, nothing new starts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rlbench.backends.hf_engine import Decoding
from rlbench.core.types import GenerateRequest

WAITING_ABORT = "Abort in waiting queue"  # SGLang's message for a request aborted before it ran
RUNNING_ABORT = "Aborted"


@dataclass
class Finish:
    """How a request ended, in SGLang's terms: "stop" (matched: a token id or a stop string),
    "length", or "abort" (message)."""

    kind: str
    matched: int | str | None = None
    message: str | None = None


@dataclass
class Job:
    """One engine request in the server, from its arrival to its answer."""

    request: GenerateRequest
    rid: str
    top_n: int = 0
    bias: dict[int, float] = field(default_factory=dict)  # logit_bias: token id -> bias
    probe: tuple[int, ...] = ()  # token_ids_logprob
    stop_strings: tuple[str, ...] = ()
    text_of: Callable[[list[int]], str] | None = None  # decodes its tokens, for stop strings
    stream: bool = False
    future: asyncio.Future | None = None
    progressed: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: float = field(default_factory=time.perf_counter)
    retractions: int = 0
    version_changes: list = field(default_factory=list)  # (the version before, tokens it produced)
    # What it has produced, copied on the event loop between two steps (consistent): at every step when
    # streamed or held to stop strings, else once it has ended.
    output_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    top: tuple = ()
    probed: tuple = ()
    cached: int = 0  # prompt tokens whose prefill the engine did not compute for it (SGLang's count)
    finish: Finish | None = None
    batch: Batch | None = None
    row: int = -1

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass
class Batch:
    """Jobs decoded together: one engine generation, advanced one token per turn."""

    jobs: list[Job]
    decoding: Decoding
    steps: Any
    over: bool = False


@dataclass
class Call:
    """A function for the engine's thread. `barrier`: it waits for the requests before it and holds
    back those after it (a weight load); otherwise it runs between two tokens."""

    fn: Callable
    args: tuple
    future: asyncio.Future
    barrier: bool


class EngineWorker:
    def __init__(self, engine, gather_s: float = 0.002, max_rows: int = 64):
        self.engine, self.gather_s, self.max_rows = engine, gather_s, max_rows
        # Each ended request as {"input_ids", "output_ids", "logprobs", "seed", "finish"}, where a list is given
        # (slime plugins under `rlbench run`: appended on the event loop, read between steps, none in flight).
        self.request_log: list[dict] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlbench-engine")
        self._queue: list[Job | Call] = []  # waiting jobs and barrier calls, in arrival order
        self._between: list[Call] = []  # calls that run between two tokens
        self._active: list[Batch] = []
        self._paused: str | None = None
        self._stepping = False
        self._deferred: list[Callable[[], None]] = []  # what waits for the step in flight to end
        self._wake: asyncio.Event | None = None
        self._resumed: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._wake, self._resumed = asyncio.Event(), asyncio.Event()
        self._resumed.set()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ---- what the routes call ------------------------------------------------------------------

    @property
    def paused(self) -> str | None:
        return self._paused

    async def unpaused(self) -> None:
        """Return once generation is not paused (new requests wait here, as in SGLang)."""
        while self._paused is not None:
            await self._resumed.wait()

    def submit(self, jobs: Sequence[Job]) -> None:
        """Queue jobs; each job's future gets the job once it has finished."""
        loop = asyncio.get_running_loop()
        for job in jobs:
            job.future = loop.create_future()
            self._queue.append(job)
        self._wake.set()

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[Job]:
        """The finished jobs of plain requests (no streaming, no stop strings)."""
        jobs = [Job(request, f"internal-{id(request)}") for request in requests]
        self.submit(jobs)
        return [await job.future for job in jobs]

    async def call(self, fn: Callable, *args: Any, barrier: bool = False) -> Any:
        """Run `fn(*args)` on the engine's thread: between two tokens, or with `barrier` after the
        requests before it (at once while paused)."""
        future = asyncio.get_running_loop().create_future()
        call = Call(fn, args, future, barrier)
        if barrier and self._paused is None:
            self._queue.append(call)
        else:
            self._between.append(call)
        self._wake.set()
        return await future

    def live_rids(self) -> set[str]:
        return {j.rid for j in self._jobs() if not j.done}

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        live = [j for j in self._jobs() if not j.done]
        running = sum(1 for j in live if j.batch is not None)
        return running, len(live) - running

    def busy(self, count_waiting: bool = True) -> bool:
        """Are requests running (or, with `count_waiting`, waiting)? What decides whether a cache flush
        may run in SGLang."""
        running = any(not j.done for b in self._active for j in b.jobs)
        waiting = any(isinstance(e, Job) for e in self._queue)
        return running or (count_waiting and waiting)

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang's /abort_request: every request (abort_all), or those whose rid starts with `rid` when
        `rid` names a live request (an unknown rid aborts nothing). How many were aborted."""
        if not abort_all and rid not in self.live_rids():
            return 0
        hit = [j for j in self._jobs() if not j.done and (abort_all or j.rid.startswith(rid))]
        self._when_idle(lambda: [self._abort(job) for job in hit])
        return len(hit)

    def version_changed(self, old: str) -> None:
        """The weight version moved on: each running request records how many of its tokens the old
        version produced (SGLang's weight_versions spans)."""
        for job in self._jobs():
            produced = len(job.batch.decoding.outputs[job.row]) if job.batch is not None else 0
            if not job.done and produced:
                job.version_changes.append((old, produced))

    def pause(self, mode: str) -> None:
        """SGLang's /pause_generation: "abort", "in_place" or "retract"."""
        self._paused = mode
        self._resumed.clear()
        if mode == "abort":
            self.abort(abort_all=True)
        elif mode == "retract":
            self._when_idle(self._retract)
        self._wake.set()

    def resume(self) -> None:
        """SGLang's /continue_generation."""
        self._paused = None
        self._resumed.set()
        self._wake.set()

    # ---- the loop --------------------------------------------------------------------------------

    def _jobs(self) -> list[Job]:
        return [j for b in self._active for j in b.jobs] + [e for e in self._queue if isinstance(e, Job)]

    def _when_idle(self, action: Callable[[], None]) -> None:
        """Run `action` now, or once the step in flight has ended (it reads the engine's state)."""
        if self._stepping:
            self._deferred.append(action)
        else:
            action()

    async def _run(self) -> None:
        while True:
            if not await self._turn():
                await self._wake.wait()
                self._wake.clear()

    async def _turn(self) -> bool:
        """One round: a call, or admitting waiting jobs, or one token of every running batch. False
        when there is nothing to do."""
        if self._between:
            call = self._between.pop(0)
            await self._settle(call)
            return True
        head = self._queue[0] if self._queue else None
        if isinstance(head, Call) and (not self._active or self._paused is not None):
            self._queue.pop(0)
            await self._settle(head)
            return True
        if isinstance(head, Job) and self._paused is None:
            if not self._active:
                await self._gather()
            self._admit()
        if self._active and self._paused != "in_place":
            await self._step()
            return True
        return False

    async def _gather(self) -> None:
        """While jobs keep arriving (each gap shorter than gather_s), let them queue."""
        seen = -1
        while self.gather_s > 0 and self._queue and isinstance(self._queue[-1], Job) and seen != len(self._queue):
            if sum(isinstance(e, Job) for e in self._queue) >= self.max_rows:
                return
            seen = len(self._queue)
            await asyncio.sleep(self.gather_s)

    def _admit(self) -> None:
        """The waiting jobs before the first barrier become one batch."""
        jobs = []
        while self._queue and isinstance(self._queue[0], Job):
            job = self._queue.pop(0)
            if not job.done:
                jobs.append(job)
        if not jobs:
            return
        decoding = Decoding.fresh(
            len(jobs),
            {i: job.top_n for i, job in enumerate(jobs)},
            {i: job.bias for i, job in enumerate(jobs)},
            {i: job.probe for i, job in enumerate(jobs)},
        )
        batch = Batch(jobs, decoding, self.engine.steps([job.request for job in jobs], decoding))
        for row, job in enumerate(jobs):
            job.batch, job.row = batch, row
        self._active.append(batch)

    async def _step(self) -> None:
        """One token of every running batch, on the engine's thread; then what it finished."""
        batches = list(self._active)
        self._stepping = True
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, _advance, batches)
        except Exception as exc:  # noqa: BLE001 - an engine failure fails its requests, never the server
            for batch in batches:
                batch.over = True
                for job in batch.jobs:
                    if not job.done:
                        job.finish = Finish("abort", message=f"engine error: {exc.__class__.__name__}: {exc}")
                        self._resolve(job)
        finally:
            self._stepping = False
        for batch in batches:
            self._collect(batch)
        self._active = [b for b in self._active if not b.over]
        deferred, self._deferred = self._deferred, []
        for action in deferred:
            action()

    def _collect(self, batch: Batch) -> None:
        """End the jobs the engine finished or a stop string ends, with a copy of their tokens (a streamed
        job's are copied at every step; the others' only once, when they end)."""
        decoding = batch.decoding
        for row, job in enumerate(batch.jobs):
            if job.done or job.batch is not batch:
                continue
            engine_finish = decoding.finished.get(row)
            if job.stream or job.stop_strings or engine_finish is not None or batch.over:
                self._copy(job)
            matched = self._stop_string(job)
            if matched is not None:
                decoding.ended.setdefault(row, "stop")
                job.finish = Finish("stop", matched=matched)
            elif engine_finish in ("stop", "length"):
                stop = job.output_ids[-1] if engine_finish == "stop" and job.output_ids else None
                job.finish = Finish(engine_finish, matched=stop)
            elif batch.over:  # never: the engine finishes every row it returns
                job.finish = Finish("abort", message="the engine ended the request without a finish reason")
            if job.done:
                self._resolve(job)
            else:
                job.progressed.set()

    def _copy(self, job: Job) -> None:
        decoding, row = job.batch.decoding, job.row
        job.output_ids = tuple(decoding.outputs[row])
        job.logprobs = tuple(decoding.logprobs[row])
        job.top = tuple(tuple(t) for t in decoding.top.get(row, ()))
        job.probed = tuple(tuple(t) for t in decoding.probed.get(row, ()))
        job.cached = decoding.cached.get(row, 0)

    @staticmethod
    def _stop_string(job: Job) -> str | None:
        """The first of the job's stop strings its text now holds (SGLang checks them before its stop
        tokens and its length)."""
        if not job.stop_strings or job.text_of is None or not job.output_ids:
            return None
        text = job.text_of(list(job.output_ids))
        found = [(text.find(s), s) for s in job.stop_strings if s and s in text]
        return min(found)[1] if found else None

    def _abort(self, job: Job) -> None:
        if job.done:
            return
        if job.batch is None:  # still waiting
            job.finish = Finish("abort", message=WAITING_ABORT)
            self._queue = [e for e in self._queue if e is not job]
        else:
            self._copy(job)
            job.batch.decoding.ended[job.row] = "abort"
            job.finish = Finish("abort", message=RUNNING_ABORT)
        self._resolve(job)

    def _retract(self) -> None:
        """Every running job back to the front of the queue, to start again from its prompt."""
        retracted = []
        for batch in self._active:
            batch.steps.close()
            for job in batch.jobs:
                if not job.done:
                    job.batch, job.row, job.output_ids, job.logprobs, job.top, job.probed = None, -1, (), (), (), ()
                    job.retractions += 1
                    retracted.append(job)
        self._active = []
        self._queue = retracted + self._queue

    def _resolve(self, job: Job) -> None:
        if self.request_log is not None:
            self.request_log.append(
                {
                    "input_ids": list(job.request.prompt_ids),
                    "output_ids": list(job.output_ids),
                    "logprobs": list(job.logprobs),
                    "seed": job.request.seed,
                    "finish": job.finish.kind,
                }
            )
        job.progressed.set()
        if job.future is not None and not job.future.done():
            job.future.set_result(job)

    async def _settle(self, call: Call) -> None:
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._executor, call.fn, *call.args)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, never lost
            if not call.future.done():
                call.future.set_exception(exc)
            return
        if not call.future.done():  # a client that went away cancelled its future
            call.future.set_result(out)


def _advance(batches: list[Batch]) -> None:
    """One step of each batch's generation (the engine's thread)."""
    with torch.no_grad():
        for batch in batches:
            if batch.over:
                continue
            try:
                next(batch.steps)
            except StopIteration:
                batch.over = True
