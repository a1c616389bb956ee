"""The engine's one thread, and the batching of concurrent requests onto it.

Every engine call (generation, a weight load, a checksum) runs on one thread, in arrival order,
so a weight update waits for the generations queued before it and the ones after it see the new
weights (SGLang's order). /generate calls waiting together are decoded as one engine batch: when
the engine is idle, the worker gathers for `gather_s` more seconds while requests keep arriving
(up to `max_rows` of them). The embedded engine is batch-invariant (rlbench/backends/hf_engine.py),
so how requests happen to be grouped never changes a request's tokens or log-probs: the grouping is
a matter of speed only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlbench.core.types import GenerateRequest, GenerateResult


class EngineWorker:
    def __init__(self, engine, gather_s: float = 0.002, max_rows: int = 64):
        self.engine, self.gather_s, self.max_rows = engine, gather_s, max_rows
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlbench-engine")
        self._queue: list[tuple[str, Any, asyncio.Future]] = []  # ("generate", requests) or ("call", (fn, args))
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return await self._submit("generate", list(requests))

    async def call(self, fn: Callable, *args: Any) -> Any:
        """Run `fn(*args)` on the engine's thread, after everything queued before it."""
        return await self._submit("call", (fn, args))

    async def _submit(self, kind: str, payload: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((kind, payload, future))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._gather()
            while self._queue:
                if self._queue[0][0] == "call":
                    _, (fn, args), future = self._queue.pop(0)
                    await self._settle([future], loop.run_in_executor(self._executor, fn, *args), single=True)
                    continue
                batch = []
                while self._queue and self._queue[0][0] == "generate":
                    batch.append(self._queue.pop(0))
                requests = [r for _, rs, _ in batch for r in rs]
                results = loop.run_in_executor(self._executor, self.engine.generate, requests)
                await self._settle([f for _, _, f in batch], results, sizes=[len(rs) for _, rs, _ in batch])

    async def _gather(self) -> None:
        """While generate requests keep arriving (each gap shorter than gather_s), let them queue."""
        seen = -1
        while self._queue and self._queue[-1][0] == "generate" and seen != len(self._queue):
            if sum(len(p) for k, p, _ in self._queue if k == "generate") >= self.max_rows or self.gather_s <= 0:
                return
            seen = len(self._queue)
            await asyncio.sleep(self.gather_s)

    @staticmethod
    async def _settle(futures: list[asyncio.Future], work: asyncio.Future, single: bool = False,
                      sizes: list[int] | None = None) -> None:
        try:
            out = await work
        except Exception as exc:  # noqa: BLE001 - handed to every waiting request, never lost
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            return
        parts = [out] if single else []
        if sizes is not None:
            start = 0
            for size in sizes:
                parts.append(out[start: start + size])
                start += size
        for future, part in zip(futures, parts):
            if not future.done():  # a client that went away cancelled its future
                future.set_result(part)
