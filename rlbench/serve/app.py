"""The routes of `rlbench serve`: SGLang 0.5.23's native API over the embedded engine.

/health, /health_generate (a one-token generation; 503 when it does not answer in 20 s), /ready,
/server_info, /model_info (and their /get_* aliases), /generate (one item, a batch, n copies, or a
stream of server-sent events), /abort_request, /pause_generation, /continue_generation,
/update_weights_from_disk, /pull_weights (slime's, pull.py), /update_weight_version, /weights_checker,
/get_weights_by_name, /flush_cache, /v1/loads. Request bodies are read to at most `max_request_bytes` (413
past it, before the rest is read) as JSON (application/json, as FastAPI takes them) and parsed off the event loop when
large; a refused request gets SGLang's answer for it (request.py), never a 5xx, and never stops the
server: an error nobody foresaw is a 400 in SGLang's ValueError shape, naming it.

With an api key (ServeConfig.api_key) auth.py's gate answers a request without it before any route.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rlbench.rundir.failpoints import hit
from rlbench.serve.auth import ApiKey
from rlbench.serve import pull
from rlbench.serve import request as rq
from rlbench.serve import request_gates as gates
from rlbench.serve.answer import Answers, delta, prompt_logprobs
from rlbench.serve.weights import LoadFailed
from rlbench.serve.worker import Job
from rlbench.serve.bodies import no_text, outside_root, update_answer, body_fields, loads_body, sse_event, json_response

HEALTH_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
    "the operation will not be performed.)\n"
)
PARSE_OFF_LOOP = 256 << 10  # bodies larger than this are parsed on a thread: the event loop keeps serving


def build_app(state) -> Starlette:
    """The server's app over `state` (server.py's ServerState): the routes, the lifespan that starts and
    stops the worker, and the error handlers. Starlette rather than FastAPI on top of it: every route reads
    its own body (request.py), so FastAPI's parameter layer had nothing to do, and it cost about 0.1-0.2 ms
    of CPU per request, as much again as Starlette's routing itself (a run sends one request per sample)."""
    h = Handlers(state)
    routes = [Route(path, h.healthy, methods=["GET"]) for path in ("/health", "/health_generate")]
    routes += [Route(path, h.server_info, methods=["GET"]) for path in ("/server_info", "/get_server_info")]
    routes += [Route(path, h.model_info, methods=["GET"]) for path in ("/model_info", "/get_model_info")]
    routes += [
        Route("/ready", h.ready, methods=["GET"]),
        Route("/generate", h.generate, methods=["POST", "PUT"]),
        Route("/abort_request", h.abort_request, methods=["POST"]),
        Route("/pause_generation", h.pause_generation, methods=["POST"]),
        Route("/continue_generation", h.continue_generation, methods=["POST"]),
        Route("/update_weights_from_disk", h.update_weights_from_disk, methods=["POST"]),
        Route("/pull_weights", partial(pull.handle, state, _json), methods=["POST"]),  # slime's patch
        Route("/update_weight_version", h.update_weight_version, methods=["POST"]),
        Route("/flush_cache", h.flush_cache, methods=["GET", "POST"]),
        Route("/weights_checker", h.weights_checker, methods=["GET", "POST"]),
        Route("/get_weights_by_name", h.get_weights_by_name, methods=["GET", "POST"]),
        Route("/v1/loads", h.loads, methods=["GET"]),
    ]
    key = state.config.api_key
    return Starlette(
        routes=routes,
        lifespan=h.lifespan,
        middleware=[Middleware(ApiKey, key=key)] if key else [],
        exception_handlers={gates.RequestError: refused, HTTPException: http_error, Exception: internal},
    )


class Handlers:
    """The handlers of the routes that read the server's state (server.py's ServerState), one method each."""

    def __init__(self, state):
        self.state = state
        self.answers = Answers(state.tokenizer, lambda: state.weight_version)

    @asynccontextmanager
    async def lifespan(self, _app: Starlette):
        """The worker runs while the server does."""
        self.state.worker.start()
        try:
            yield
        finally:
            await self.state.worker.stop()

    # ---- health and information ---------------------------------------------------------------

    async def healthy(self, _request: Request) -> Response:
        """200 once a one-token generation answers within HEALTH_TIMEOUT_S, else 503."""
        from rlbench.core.types import GenerateRequest

        probe = GenerateRequest((0,), 42, 1, 0.0, ())
        try:
            await asyncio.wait_for(self.state.worker.generate([probe]), HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure to answer is "unhealthy", as in SGLang
            return Response(status_code=503)
        return Response(status_code=200)

    async def ready(self, _request: Request) -> Response:
        return Response(status_code=200)

    async def server_info(self, _request: Request) -> Response:
        return json_response(self.state.server_info())

    async def model_info(self, _request: Request) -> Response:
        return json_response(self.state.model_info())

    async def loads(self, _request: Request) -> Response:
        """SGLang's /v1/loads, its core section: what runs and what waits."""
        running, waiting = self.state.worker.counts()
        load = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "max_total_num_tokens": self.state.context_len * self.state.config.decode_batch_size,
        }
        return json_response(
            {
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "version": self.state.version,
                "accelerator": None,
                "num_accelerators": 1,
                "loads": [load],
            }
        )

    # ---- generation ---------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        """One item, a batch or n copies, answered in SGLang's shape (answer.py); streamed as server-sent
        events with `stream`."""
        state = self.state
        body = await _json(request, state.config.max_request_bytes, required=True)
        encode = state.encode if state.tokenizer is not None else no_text
        try:
            call = await _maybe_off_loop(request, lambda: rq.parse_generate(body, state.vocab, encode))
        except gates.RequestError as exc:  # SGLang checks values inside the stream: a stream gets them in-band
            if isinstance(body, dict) and body.get("stream") is True and isinstance(exc.body.get("error"), dict):
                return StreamingResponse(_error_events(exc), media_type="text/event-stream")
            raise
        if call.stream:
            return StreamingResponse(self._stream(call), media_type="text/event-stream")
        jobs, prompts = await self._start(call)
        done = await asyncio.gather(*(job.future for job in jobs))
        items = [
            self.answers.build(item, job, prompt, call.return_text_in_logprobs, final=True)
            for item, job, prompt in zip(call.items, done, prompts)
        ]
        return json_response(items if call.batched else items[0])

    async def _start(self, call: rq.GenerateCall) -> tuple[list[Job], list]:
        """Check the items' lengths and rids, wait out a pause, score prompts where asked, submit."""
        state = self.state
        rq.limit_items(call, state.context_len, state.eos, 42)
        if state.tokenizer is None and any(item.sampling.stop for item in call.items):
            stops = next(item.sampling.stop for item in call.items if item.sampling.stop)
            raise gates.value(
                f"stop={list(stops)!r} is unavailable when skip_tokenizer_init=True (requires tokenizer to "
                "decode tokens to text for matching)."
            )
        live = state.worker.live_rids()
        for item in call.items:
            if item.rid in live:
                raise gates.value(f"Duplicate request ID detected: {item.rid}")
        await state.worker.unpaused()
        hit("serve.generate")
        prompts = []
        for item in call.items:
            start = item.logprob_start_len if item.return_logprob else -1
            prompts.append(
                None
                if start < 0
                else await state.worker.call(
                    lambda i=item, s=start: prompt_logprobs(
                        state.engine.model,
                        i.prompt_ids,
                        s,
                        i.request.temperature,
                        i.top_logprobs_num,
                        state.config.device,
                        i.probe,
                    )
                )
            )
        jobs = [
            Job(
                item.request,
                item.rid,
                top_n=item.top_logprobs_num if item.return_logprob else 0,
                bias=dict(item.sampling.logit_bias),
                probe=item.probe if item.return_logprob else (),
                stop_strings=item.sampling.stop,
                text_of=self._text_of(item),
                stream=call.stream,
            )
            for item in call.items
        ]
        state.worker.submit(jobs)
        return jobs, prompts

    def _text_of(self, item: rq.Item):
        if not item.sampling.stop:
            return None
        skip = item.sampling.skip_special_tokens
        return lambda ids: self.state.tokenizer.decode(ids, skip_special_tokens=skip)

    async def _stream(self, call: rq.GenerateCall):
        """SGLang's server-sent events: a chunk every stream_interval new tokens of an item (batch chunks carry
        "index"), its last with the finish reason, then [DONE]; an error after the stream began comes in-band,
        under HTTP 200. Chunks are cumulative, or with --incremental-streaming-output only what is new since
        the item's last chunk (answer.py `delta`)."""
        try:
            jobs, prompts = await self._start(call)
        except gates.RequestError as exc:
            async for event in _error_events(exc):
                yield event
            return
        incremental = self.state.config.incremental_streaming_output
        sent = [0] * len(jobs)  # tokens each item's chunks have shown (a retracted item restarts below it)
        shown = [""] * len(jobs)  # the text an item's incremental chunks have carried
        pending = set(range(len(jobs)))
        while pending:
            waits = [asyncio.ensure_future(jobs[i].progressed.wait()) for i in pending]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()
            for i in sorted(pending):
                job = jobs[i]
                if not job.progressed.is_set():
                    continue
                job.progressed.clear()
                if not job.done and len(job.output_ids) < sent[i] + call.items[i].sampling.stream_interval:
                    continue
                chunk = self.answers.build(call.items[i], job, prompts[i], call.return_text_in_logprobs, job.done)
                if incremental:
                    chunk, shown[i] = delta(chunk, sent[i], shown[i], job.done)
                if call.batched:
                    chunk["index"] = i
                sent[i] = len(job.output_ids)
                if job.done:
                    pending.discard(i)
                yield sse_event(chunk)
        yield b"data: [DONE]\n\n"

    # ---- control ------------------------------------------------------------------------------

    async def abort_request(self, request: Request) -> Response:
        """SGLang's /abort_request {rid, abort_all}: 200 with an empty body."""
        body = body_fields(
            await _json(request, self.state.config.max_request_bytes, required=True),
            {"rid": (str, type(None)), "abort_all": bool},
        )
        self.state.worker.abort(body.get("rid") or "", bool(body.get("abort_all", False)))
        return Response(status_code=200)

    async def pause_generation(self, request: Request) -> Response:
        body = body_fields(await _json(request, self.state.config.max_request_bytes, required=True), {"mode": str})
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise gates.pydantic_error(
                "mode", "literal_error", "Input should be 'abort', 'retract' or 'in_place'", mode
            )
        self.state.worker.pause(mode)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        body_fields(
            await _json(request, self.state.config.max_request_bytes, required=True), {"torch_empty_cache": bool}
        )
        self.state.worker.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: Request) -> Response:
        """Empty the engine's prompt cache, as SGLang its radix cache: refused (400) while requests run (or
        wait, unless generation is paused), after waiting up to ?timeout= seconds for them."""
        try:
            timeout = float(request.query_params.get("timeout", 0.0))
        except ValueError:
            raise gates.pydantic_error(
                "timeout", "float_parsing", "Input should be a valid number", request.query_params.get("timeout")
            ) from None
        if not timeout >= 0:
            raise gates.pydantic_error(
                "timeout", "greater_than_equal", "Input should be greater than or equal to 0", timeout
            )
        worker, deadline = self.state.worker, time.monotonic() + timeout
        while worker.busy(count_waiting=worker.paused is None) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if worker.busy(count_waiting=worker.paused is None):
            return Response(content="Flush cache failed.\n", status_code=400)
        await worker.call(self.state.engine.forget_prompts)
        return Response(content=FLUSHED, status_code=200)

    async def update_weights_from_disk(self, request: Request) -> Response:
        """Load a model directory's weights (or the seeded dummy ones), whole or not at all, after the
        requests before it; take its weight version. SGLang's answer: {success, message,
        num_paused_requests}, 400 when it failed (the served weights then unchanged)."""
        state = self.state
        body = body_fields(
            await _json(request, state.config.max_request_bytes, required=True),
            {
                "model_path": str,
                "load_format": (str, type(None)),
                "abort_all_requests": bool,
                "weight_version": (str, type(None)),
                "is_async": bool,
                "torch_empty_cache": bool,
                "keep_pause": bool,
                "recapture_cuda_graph": bool,
                "token_step": int,
                "flush_cache": bool,
                "manifest": (dict, type(None)),
            },
            required=("model_path",),
        )
        refused = [k for k in ("is_async", "keep_pause", "manifest") if body.get(k)]
        if refused:
            return update_answer(False, f"rlbench serve does not implement {refused[0]} (docs/sglang-ray.md)")
        outside = outside_root(body["model_path"], state.config.weights_root())
        if outside:
            return update_answer(False, outside)
        if body.get("abort_all_requests"):
            state.worker.abort(abort_all=True)
        fmt = body.get("load_format") or state.load_format
        try:
            message = await state.worker.call(state.load_weights, body["model_path"], fmt, barrier=True)
        except LoadFailed as exc:
            return update_answer(False, str(exc))
        if body.get("weight_version") is not None:
            self._set_version(body["weight_version"])
        if body.get("torch_empty_cache") and state.config.device.startswith("cuda"):
            import torch

            await state.worker.call(torch.cuda.empty_cache)
        # recapture_cuda_graph: there are no CUDA graphs to capture; token_step: 0.5.23 answers nothing of it.
        if body.get("flush_cache", True) and state.worker.busy(count_waiting=False):
            return update_answer(
                False,
                "Weights were updated, but the cache was not flushed because requests are "
                "still running or queued. Retract or finish them, then call /flush_cache.",
            )
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {body['weight_version']}."
        return update_answer(True, message)

    def _set_version(self, version: str) -> None:
        old, self.state.weight_version = self.state.weight_version, version
        if old != version:
            self.state.worker.version_changed(old)

    async def update_weight_version(self, request: Request) -> Response:
        body = body_fields(
            await _json(request, self.state.config.max_request_bytes, required=True),
            {"new_version": str, "abort_all_requests": bool},
            required=("new_version",),
        )
        if body.get("abort_all_requests", True):
            self.state.worker.abort(abort_all=True)
        self._set_version(body["new_version"])
        return json_response(
            {
                "success": True,
                "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"],
            }
        )

    async def weights_checker(self, request: Request) -> Response:
        """SGLang's /weights_checker (weights.py): checksum by default, snapshot, compare, reset_tensors."""
        body = await _json(request, self.state.config.max_request_bytes, required=False)
        body = body_fields(
            body if body is not None else {},
            {"action": str, "allow_quant_error": bool, "skip_tensor_list": (list, type(None)), "selector": str},
        )
        selector = body.get("selector", "all")
        if selector not in ("target", "draft", "all"):
            raise gates.pydantic_error(
                "selector", "literal_error", "Input should be 'target', 'draft' or 'all'", selector
            )
        skip = body.get("skip_tensor_list")
        if skip is not None and not all(isinstance(s, str) for s in skip):
            raise gates.pydantic_error("skip_tensor_list", "string_type", "Input should be a valid string", skip)
        action = body.get("action", "checksum")
        if selector == "draft":  # no draft model: nothing to check, as SGLang answers without a draft runner
            return json_response({"success": True, "message": "Success."})
        answer = await self.state.worker.call(self._check, action, skip)
        return json_response(answer, status_code=200 if answer["success"] else 400)

    def _check(self, action: str, skip: list[str] | None) -> dict:
        """The checker's action (the engine's thread); reset_tensors rewrites the weights in place, so the
        prompts the engine keeps are forgotten in the same call (no request between sees them)."""
        answer = self.state.checker.handle(self.state.engine.model, action, skip)
        if action == "reset_tensors":
            self.state.engine.forget_prompts()
        return answer

    async def get_weights_by_name(self, request: Request) -> Response:
        """The first `truncate_size` rows of the named parameter (a tied lm_head reads the embeddings), as
        SGLang's model answers; an unknown name is its 400."""
        body = body_fields(
            await _json(request, self.state.config.max_request_bytes, required=True),
            {"name": str, "truncate_size": int},
            required=("name",),
        )
        size = body.get("truncate_size", 100)

        def read() -> Any:
            model = self.state.engine.model
            params = dict(model.named_parameters())
            name = body["name"]
            if name == "lm_head.weight" and name not in params and getattr(model.config, "tie_word_embeddings", False):
                name = "model.embed_tokens.weight"
            if name not in params:
                return None
            return params[name].detach().cpu().float()[: max(size, 0)].tolist()

        values = await self.state.worker.call(read)
        if values is None:
            raise gates.value("Get parameter by name failed")
        return json_response(values)


async def _error_events(exc: gates.RequestError):
    """A ValueError after a stream began, as SGLang sends it: in-band, then [DONE]."""
    message = exc.body["error"]["message"] if isinstance(exc.body.get("error"), dict) else str(exc.body)
    yield sse_event(
        {"error": {"message": message, "type": "invalid_request_error", "code": exc.status, "retryable": False}}
    )
    yield b"data: [DONE]\n\n"


async def refused(_request: Request, exc: gates.RequestError) -> Response:
    """A refused request (request.py): SGLang's answer for it."""
    return json_response(exc.body, status_code=exc.status)


async def http_error(_request: Request, exc: HTTPException) -> Response:
    """404, 405: JSON, as SGLang's FastAPI answers."""
    return json_response({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def internal(_request: Request, exc: Exception) -> Response:
    """What nothing above foresaw: a 400 in SGLang's ValueError shape, naming it (a request never gets a
    5xx from rlbench serve); the server lives on."""
    return json_response({"error": {"message": f"{exc.__class__.__name__}: {str(exc)[:300]}"}}, status_code=400)


async def _json(request: Request, limit: int, *, required: bool) -> Any:
    """The request's JSON body, read to at most `limit` bytes (413 past it, before the rest is read), taken
    only as application/json (FastAPI's rule: another content type is not parsed, the pydantic envelope
    answers). A missing body is None when not `required`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise gates.http_error(413, f"Request body of {declared} bytes is larger than this server reads ({limit}).")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise gates.http_error(413, f"Request body is larger than this server reads ({limit} bytes).")
            chunks.append(chunk)
    except ClientDisconnect:
        raise gates.envelope("the client went away before its body was read") from None
    raw = b"".join(chunks)
    if not raw:
        if required:
            raise gates.pydantic_error("", "missing", "Field required", None)
        return None
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "application/json" and not (
        content_type.startswith("application/") and content_type.endswith("+json")
    ):
        raise gates.pydantic_error(
            "",
            "model_attributes_type",
            "Input should be a valid dictionary or object to extract fields from",
            raw[:200],
        )
    route = f"{request.method} {request.url.path}"
    if len(raw) > PARSE_OFF_LOOP:
        return await asyncio.to_thread(loads_body, raw, route)
    return loads_body(raw, route)


async def _maybe_off_loop(request: Request, parse):
    """Run `parse` on a thread when the body was large (tokenising a long text must not stall the loop)."""
    size = int(request.headers.get("content-length") or 0)
    return await asyncio.to_thread(parse) if size > PARSE_OFF_LOOP else parse()
