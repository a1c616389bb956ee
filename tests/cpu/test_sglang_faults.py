"""Servers that fail the run, and what the run does about them.

- Servers a run starts itself, all of them dying: the run stops with exit 2 and one line, its committed
  steps intact and nothing of the failed step recorded; `--resume` starts new servers and finishes the
  run with the checksums of a run that was never disturbed; Ctrl-C stops a run too; each time no process
  the run started is left behind (and none after a clean stop either: test_sglang.py's fleet fixture).
- An SGLang-shaped server (`SGLangShaped`: `rlbench serve` behind a proxy that answers as SGLang 0.5.23's
  code does: extra meta_info keys, null texts, its two abort answers, its "NaN happened" string `matched`,
  and, on purpose, wrong answers): aborted and wrong answers are never trained. Retried, the run writes
  the undisturbed run's checksums; when every attempt fails, it stops with exit 2 naming the server and
  the field, nothing of that step recorded, and `--resume` finishes it identically.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rlbench.config import apply_overrides
from rlbench.core.loop import run
from rlbench.errors import EngineUnavailable
from rlbench.rundir.directory import read_run
from tests.conftest import cli, small_toml, tagged_processes
from tests.cpu.conftest import ThreadedApp


def _checksums(run_dir: Path) -> bytes:
    return (run_dir / "checksums.jsonl").read_bytes()


def test_every_server_dead_stops_the_run_then_resume_finishes_it(tmp_path, reference, monkeypatch):
    """Servers the run starts itself (one `rlbench serve` behind a router it starts): the server dies at
    step 1's fourth request (a failpoint in it). No engine answers: exit 2, one line, step 0 committed
    and readable, nothing of step 1 recorded, nothing left running. Resumed, with a Ctrl-C
    (KeyboardInterrupt, as Python raises it) once its last step is committed: the reference run's
    checksums, and again nothing left running."""
    from rlbench.replay.resume import resume

    tag = uuid.uuid4().hex
    monkeypatch.setenv("RLBENCH_TEST_TAG", tag)  # inherited by every process the run starts
    (tmp_path / "s.toml").write_text(small_toml(3))
    out = tmp_path / "run"
    monkeypatch.setenv("RLBENCH_FAILPOINT", "serve.generate@12")  # the server's 12th /generate: step 1's 4th
    res = cli("run", "-c", str(tmp_path / "s.toml"), "--rollout", "sglang", "--sglang-server", "rlbench",
              "--out", str(out), "--json")
    monkeypatch.delenv("RLBENCH_FAILPOINT")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("rlbench: error: no SGLang server answers: http://127.0.0.1:"), lines[0]
    assert read_run(out).steps == [0] and not list((out / "rollouts").glob("000001*"))
    assert tagged_processes(tag) == []

    def interrupt(state):
        if state.step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        resume(out, on_step=interrupt)
    assert read_run(out).steps == [0, 1, 2]
    assert _checksums(out) == _checksums(reference)
    assert tagged_processes(tag) == []


# ---- an SGLang-shaped server -------------------------------------------------------------------------


def _abort_running(answer: dict) -> dict:
    """SGLang 0.5.23's answer to a running request aborted (/abort_request, a pause): 200, the partial output,
    finish {"type": "abort", "message": "Aborted", "status_code": null, "err_type": null}."""
    meta = dict(answer["meta_info"])
    keep = max(len(answer["output_ids"]) // 2, 1)
    meta.update(finish_reason={"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
                completion_tokens=keep, output_token_logprobs=meta["output_token_logprobs"][:keep],
                output_token_logprobs_length=keep)
    return {"text": None, "output_ids": answer["output_ids"][:keep], "meta_info": meta}


def _abort_waiting(answer: dict) -> dict:
    """SGLang 0.5.23's answer to a request aborted in the waiting queue (tokenizer_manager._handle_abort_req):
    no tokens, a short meta_info."""
    meta = answer["meta_info"]
    return {"text": "", "output_ids": [], "meta_info": {
        "id": meta["id"], "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": meta["weight_version"], "e2e_latency": 0.01, "input_token_logprobs": [],
        "output_token_logprobs": [], "output_token_logprobs_length": 0, "completion_tokens": 0}}


def _nan(answer: dict) -> dict:
    """SGLang's vocabulary-boundary finish (schedule_batch._check_vocab_boundary_finish): the id replaced by
    the EOS, matched the string "NaN happened"."""
    meta = dict(answer["meta_info"], finish_reason={"type": "stop", "matched": "NaN happened"})
    return {**answer, "meta_info": meta}


def _entries(answer: dict, edit: Callable[[list], list]) -> dict:
    meta = dict(answer["meta_info"])
    meta["output_token_logprobs"] = edit([list(e) for e in meta["output_token_logprobs"]])
    ids = [e[1] for e in meta["output_token_logprobs"]]
    return {**answer, "output_ids": ids, "meta_info": meta}


WRONG = {  # answers no SGLang should give, each with the field the run must name
    "oov": (lambda a: _entries(a, lambda es: [[lp, 100_000, t] for lp, _, t in es]), "token id"),
    "negative-id": (lambda a: _entries(a, lambda es: [[lp, -3, t] for lp, _, t in es]), "token id"),
    "positive-logprob": (lambda a: _entries(a, lambda es: [[0.5, i, t] for _, i, t in es]), "logprob"),
    "too-many": (lambda a: _entries(a, lambda es: es + es + es), "at most max_new_tokens"),
    "empty-length": (lambda a: {**_entries(a, lambda es: []), "meta_info": {
        **_entries(a, lambda es: [])["meta_info"], "finish_reason": {"type": "length", "length": 4}}},
        "length only with exactly max_new_tokens"),
}


class SGLangShaped(ThreadedApp):
    """`rlbench serve` (on a thread, the run's model and seed) behind an aiohttp proxy (on a thread) that
    answers /generate as SGLang 0.5.23 does: every answer with extra meta_info keys and a null text, and the
    n-th answer rewritten by `plan(n, answer, request body)` (an abort, a wrong answer, or itself). The other
    routes pass through."""

    def __init__(self, config, plan: Callable[[int, dict, dict], dict] = lambda n, answer, body: answer):
        from aiohttp import web

        from rlbench.serve.server import ServeConfig, serve_in_thread

        self.backend = serve_in_thread(ServeConfig(
            model_path=config.model.path, tokenizer_path=config.model.tokenizer, load_format="dummy", port=0,
            random_seed=config.seed, dtype=config.model.dtype, threads=config.threads, decode=config.rollout.decode,
            decode_batch_size=config.rollout.decode_batch_size,
            weights_dir=tempfile.gettempdir()))  # where the run's engine writes its weight versions
        self.plan, self.count, self.rewritten = plan, 0, 0
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._proxy)
        super().__init__(app)

    async def _proxy(self, request):
        import aiohttp
        from aiohttp import web

        body = await request.read()
        async with aiohttp.ClientSession() as session:
            async with session.request(request.method, self.backend.url + request.path, data=body,
                                       headers={"Content-Type": "application/json"}) as answer:
                raw, status = await answer.read(), answer.status
        if request.path != "/generate" or status != 200:
            return web.Response(body=raw, status=status, content_type="application/json")
        import json

        answer = json.loads(raw)
        answer["meta_info"]["response_sent_to_client_ts"] = time.time()  # what a finished 0.5.23 answer adds
        answer["meta_info"]["dp_rank"] = 0
        answer["text"] = None
        self.count += 1
        shaped = self.plan(self.count, answer, json.loads(body))
        self.rewritten += shaped is not answer
        return web.json_response(shaped)

    def close(self):
        super().close()
        self.backend.close()


def _through(config, server: SGLangShaped, out: Path, **overrides):
    return apply_overrides(config, out=str(out), rollout__backend="sglang",
                           rollout__external_engine_addrs=(server.url,), rollout__use_router=False, **overrides)


def test_aborted_and_wrong_answers_are_retried_and_the_run_is_the_reference(small_config, reference, tmp_path):
    """Every 5th answer aborted (running or waiting form, by turns), every 7th a "NaN happened" stop, every
    11th a wrong one: all retried with their seeds, the run writes the undisturbed run's checksums."""
    kinds = list(WRONG.values())

    def plan(n, answer, _body):
        if n % 5 == 0:
            return (_abort_running if n % 10 else _abort_waiting)(answer)
        if n % 7 == 0:
            return _nan(answer)
        if n % 11 == 0:
            return kinds[(n // 11) % len(kinds)][0](answer)
        return answer

    server = SGLangShaped(small_config, plan)
    try:
        run(_through(small_config, server, tmp_path / "run"))
        assert server.rewritten >= 8
    finally:
        server.close()
    assert _checksums(tmp_path / "run") == _checksums(reference)


def test_a_server_that_always_answers_wrongly_names_the_field(small_config):
    """A server whose every answer to a request is wrong in one way (by the request's seed: each way in
    turn): the request fails after its attempts with EngineUnavailable (exit 2) naming the server and the
    field; nothing is returned to train on."""
    from rlbench.backends.sglang.client import Client
    from rlbench.backends.sglang.engine import SGLangEngine
    from rlbench.backends.sglang.fleet import Fleet
    from rlbench.core.types import GenerateRequest

    kinds = sorted(WRONG)
    def plan(_n, answer, body):
        return WRONG[kinds[body["sampling_params"]["sampling_seed"]]][0](answer)

    server = SGLangShaped(small_config, plan)
    config = _through(small_config, server, Path("unused"), rollout__request_attempts=2)
    engine = SGLangEngine(config, Fleet(route=[server.url], workers=[server.url]), Client(8, 30))
    try:
        for seed, kind in enumerate(kinds):
            with pytest.raises(EngineUnavailable, match=rf"failed 2 times, the last: {server.url}/generate: "
                                                        rf".*{WRONG[kind][1]}"):
                engine.generate([GenerateRequest((5, 6, 7), seed, 4, 1.0, (2,))])
    finally:
        engine.close()
        server.close()


def test_a_step_whose_answers_all_abort_stops_the_run_and_resume_finishes_it(small_config, reference, tmp_path):
    """Every answer of step 1 aborted: exit 2 (EngineUnavailable) naming the server and the abort, step 0
    committed and nothing of step 1 recorded; resumed against the healthy server, the run's checksums are
    the undisturbed run's."""
    per_step = small_config.data.prompts_per_step * small_config.rollout.n_samples_per_prompt
    broken = {"on": True}

    def plan(n, answer, _body):
        return _abort_running(answer) if broken["on"] and n > per_step else answer

    from rlbench.replay.resume import resume

    server = SGLangShaped(small_config, plan)
    out = tmp_path / "run"
    try:
        with pytest.raises(EngineUnavailable, match=rf"{server.url}/generate: meta_info.finish_reason: the server "
                                                    r"aborted the request \(Aborted\)"):
            run(_through(small_config, server, out, rollout__request_attempts=2))
        assert read_run(out).steps == [0] and not list((out / "rollouts").glob("000001*"))
        broken["on"] = False
        resume(out)
    finally:
        server.close()
    assert _checksums(out) == _checksums(reference)
