"""A slime generate function that blocks its event loop (a synchronous call inside a coroutine, as a plugin calling
a blocking tool client does): step 0 generates as slime's default does; in step 1 the first call opens the FIFO
named by BLOCKING_PLUGIN_FIFO (the test's event: the plugin has the loop) and sleeps without yielding."""

from __future__ import annotations

import os
import time

from tests.slime_plugins.examples import single_turn


async def blocks_in_step_1(args, sample, sampling_params):
    if sample.group_index < args.rollout_batch_size:
        return await single_turn(args, sample, sampling_params)
    with open(os.environ["BLOCKING_PLUGIN_FIFO"], "w") as fifo:
        fifo.write("blocked\n")
    time.sleep(3600)  # never yields: the loop thread is held until the process ends
    raise AssertionError("the run was not stopped")
