"""Fixtures shared by CPU tests: the rollout paths' reference run and test servers, megatron-core's one-rank state
(tests/conftest.py holds the suite-wide ones)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlbench.config import apply_overrides


@pytest.fixture(scope="session")
def reference(small_config, tmp_path_factory) -> Path:
    """The undisturbed in-process run of `small_config` (embedded engine, torch trainer), made once per
    session (per xdist worker); the runs the rollout tests hold to its files only read it."""
    from rlbench.session import run

    out = tmp_path_factory.mktemp("reference") / "run"
    run(apply_overrides(small_config, out=str(out)))
    return out


class ThreadedApp:
    """An aiohttp application served on 127.0.0.1 (a free port: `url`) from an event loop on a daemon thread
    of this process: the stand-in SGLang servers of test_sglang.py and test_sglang_faults.py. `close()` stops
    it and closes its loop (else the loop's self-pipe is left for the garbage collector to warn about in a
    later test)."""

    def __init__(self, app):
        import asyncio
        import threading

        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def one_rank():
    """megatron-core's parallel state over a one-process gloo group, torn down afterwards."""
    import torch.distributed as dist

    from rlbench.backends.megatron import compat
    from rlbench.backends.megatron import model as mmodel

    with mmodel.quiet():
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    compat.apply()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()
