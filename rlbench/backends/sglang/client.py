"""The HTTP client of SGLang's native API: aiohttp on an event loop of its own, driven synchronously.

aiohttp rather than httpx: sglang-router already installs it (no new dependency), SGLang's own
benchmark client uses it, and its connection pool keeps one keep-alive connection per in-flight
request, which is what a few hundred concurrent /generate calls need. The loop calls the engine
synchronously, so the client runs its own event loop with `run()`; the session and its connections
live as long as the client.

Bounded: at most `max_inflight` requests at a time (a semaphore, and the pool's own limit); each
request times out after `timeout_s` (rollout.request_timeout), or sooner where its call asks (a probe).
A request that fails in a way another attempt can mend (no connection, a timeout, 408, 429 or a 5xx)
raises `Retryable`; any other status is the server refusing the request, BadInput naming the URL and
its answer.

A fleet that needs a key (SGLang's --api-key, `rlbench serve --api-key`) gets it from the environment
variable RLBENCH_SGLANG_API_KEY, sent as `Authorization: Bearer KEY` on every request. It is no setting
(never in a config or a manifest) and never printed: errors name the URL and the answer, not headers.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from typing import Any

from rlbench.errors import BadInput
from rlbench.keys import client_api_key

RETRY_STATUSES = {408, 429, 500, 502, 503, 504}  # what sglang-router itself retries


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (the router extra brings it): a step sends one request
    per sample, so the loop's cost per request counts; uvloop's is lower than asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class Retryable(Exception):
    """This attempt failed, another (on another engine, or later) may not. `unreachable`: no
    connection at all (refused, or dropped before an answer), which is how a dead server looks."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


def api_key() -> str | None:
    """The key the fleet asks for (rlbench.keys.CLIENT_API_KEY_ENV), or None when unset or empty."""
    return client_api_key()


class Client:
    def __init__(self, max_inflight: int = 256, timeout_s: float = 600.0):
        self.max_inflight, self.timeout_s = max_inflight, timeout_s
        key = api_key()
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._loop = _new_loop()
        self._session = None
        self._slots: asyncio.Semaphore | None = None

    def run(self, work: Coroutine) -> Any:
        """Run a coroutine of this client to completion (from synchronous code). A Ctrl-C while it runs
        cancels it, and KeyboardInterrupt is raised here once every task of the loop has ended (each
        one's exception retrieved), as asyncio.run does: Python's own handler would raise it inside the
        loop, in whichever callback ran, and a callback of aiohttp's (a transport's, a request body
        writer's) logs it as a traceback of its own ("Task exception was never retrieved"). A second
        Ctrl-C raises at once."""
        task = self._loop.create_task(work)
        interrupted = False

        def on_sigint(signum, frame) -> None:
            nonlocal interrupted
            if interrupted:
                raise KeyboardInterrupt
            interrupted = True
            self._loop.call_soon_threadsafe(task.cancel)

        ours = threading.current_thread() is threading.main_thread()
        ours = ours and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if ours:
            signal.signal(signal.SIGINT, on_sigint)
        try:
            result = self._loop.run_until_complete(task)
        except BaseException:
            self._settle()
            if interrupted:
                raise KeyboardInterrupt from None
            raise
        finally:
            if ours:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        if interrupted:  # the work ended before it saw its cancel
            raise KeyboardInterrupt
        return result

    def _settle(self) -> None:
        """Cancel every task still on the loop and wait for each to end, retrieving its exception."""
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

    def limit(self, timeout_s: float | None) -> float:
        """The seconds a call may take: `timeout_s` where the call gives one, never more than the configured
        `self.timeout_s` (every call ends: aiohttp reads a timeout of None as none at all)."""
        return self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)

    async def _open(self):
        if self._session is None:
            import aiohttp
            import orjson

            self._slots = asyncio.Semaphore(self.max_inflight)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_inflight, force_close=False),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers=self._headers,
                json_serialize=lambda obj: orjson.dumps(obj).decode(),
            )
        return self._session

    async def call(self, method: str, url: str, body: Any = None, timeout_s: float | None = None) -> tuple[int, Any]:
        """(status, the answer's JSON, or its text when it is not JSON); Retryable when another attempt may do.
        `body` is sent as JSON, or as it is when it is bytes already."""
        import aiohttp
        import orjson

        session = await self._open()
        limit = self.limit(timeout_s)
        async with self._slots:
            try:
                data = (
                    {"data": body, "headers": {"Content-Type": "application/json"}}
                    if isinstance(body, bytes)
                    else {"json": body}
                )
                async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=limit), **data) as response:
                    raw = await response.read()
                    status = response.status
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                unreachable = isinstance(
                    exc, (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError)
                )
                said = str(exc) or f"no answer within {limit:g} s"  # a timeout says nothing of itself
                raise Retryable(f"{method} {url}: {exc.__class__.__name__}: {said}", unreachable) from None
        try:
            data = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            data = raw.decode(errors="replace")
        if status in RETRY_STATUSES:
            raise Retryable(f"{method} {url}: {status} {str(data)[:200]}")
        return status, data

    async def ok(self, method: str, url: str, body: Any = None, timeout_s: float | None = None) -> Any:
        """The answer of a call that must succeed (2xx); another status is BadInput naming the URL."""
        status, data = await self.call(method, url, body, timeout_s)
        if status == 401:
            said = "was refused" if self._headers else "is needed: set it"
            raise BadInput(f"answered 401 Unauthorized: the fleet's api key (RLBENCH_SGLANG_API_KEY) {said}", path=url)
        if not 200 <= status < 300:
            raise BadInput(f"answered {status}: {str(data)[:300]}", path=url)
        return data

    async def alive(self, url: str, timeout_s: float = 5.0) -> bool:
        """Does a server answer at all (any status, GET /model_info)? Only a refused or dropped
        connection says no: a slow answer is a busy server, not a dead one."""
        try:
            await self.call("GET", f"{url}/model_info", timeout_s=timeout_s)
        except Retryable as exc:
            return not exc.unreachable
        return True

    def close(self) -> None:
        if self._session is not None:
            self.run(self._session.close())
            self._session = None
        self._loop.close()
