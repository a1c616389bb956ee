"""The routes of `rlbench serve`: SGLang's native API over the embedded engine.

/health and /health_generate (a one-token generation, 503 when it does not answer in 20 s),
/server_info and /model_info (and their /get_* aliases, which sglang-router asks for on
registration), /generate (one item or a batch), /update_weights_from_disk (a Hugging Face-format
directory of safetensors, with its weight version), /flush_cache (there is no cache between
calls: it answers as SGLang does), /weights_checker {"action": "checksum"} and /get_weights_by_name
(for the weight-update check: see weights_payload). Request bodies are read by wire.py; a malformed
one is a 400 in SGLang's shape, never a 5xx, and never stops the server.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rlbench.backends.sglang import wire
from rlbench.core.types import GenerateRequest
from rlbench.errors import BadInput
from rlbench.rundir.failpoints import hit

HEALTH_TIMEOUT_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
           "the operation will not be performed.)\n")


def build_app(state) -> Starlette:
    """The server's app over `state` (server.py's ServerState): the routes, the lifespan that starts and
    stops the batching worker, and the error handlers. Starlette rather than FastAPI on top of it: every
    route reads its own body (wire.py), so FastAPI's parameter layer had nothing to do, and it cost about
    0.1-0.2 ms of CPU per request, as much again as Starlette's routing itself (a run sends one request
    per sample)."""
    handlers = Handlers(state)
    routes = [Route(path, handlers.healthy, methods=["GET"]) for path in ("/health", "/health_generate")]
    routes += [Route(path, handlers.server_info, methods=["GET"]) for path in ("/server_info", "/get_server_info")]
    routes += [Route(path, handlers.model_info, methods=["GET"]) for path in ("/model_info", "/get_model_info")]
    routes += [Route("/generate", handlers.generate, methods=["POST", "PUT"]),
               Route("/update_weights_from_disk", handlers.update_weights_from_disk, methods=["POST"]),
               Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
               Route("/weights_checker", handlers.weights_checker, methods=["POST"]),
               Route("/get_weights_by_name", handlers.get_weights_by_name, methods=["GET", "POST"])]
    return Starlette(routes=routes, lifespan=handlers.lifespan,
                     exception_handlers={wire.RequestError: refused, HTTPException: http_error, Exception: internal})


class Handlers:
    """The handlers of the routes that read the server's state (server.py's ServerState), one method each."""

    def __init__(self, state):
        self.state = state

    @asynccontextmanager
    async def lifespan(self, _app: Starlette):
        """The batching worker runs while the server does."""
        self.state.worker.start()
        try:
            yield
        finally:
            await self.state.worker.stop()

    async def healthy(self, _request: Request) -> Response:
        """200 once a one-token generation answers within HEALTH_TIMEOUT_S, else 503."""
        probe = GenerateRequest((0,), wire.DEFAULT_SEED, 1, 0.0, ())
        try:
            await asyncio.wait_for(self.state.worker.generate([probe]), HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure to answer is "unhealthy", as in SGLang
            return Response(status_code=503)
        return Response(status_code=200)

    async def server_info(self, _request: Request) -> Response:
        return _json_response(self.state.server_info())

    async def model_info(self, _request: Request) -> Response:
        return _json_response(self.state.model_info())

    async def generate(self, request: Request) -> Response:
        """One item or a batch, answered in SGLang's shape (`_answer`)."""
        state, started = self.state, time.perf_counter()
        call = wire.parse_generate(await _json(request), state.vocab, state.context_len,
                                   lambda text: state.tokenizer.encode(text, add_special_tokens=False),
                                   lambda: uuid.uuid4().hex)
        hit("serve.generate")
        results = await state.worker.generate(call.requests)
        latency = time.perf_counter() - started
        items = [_answer(state, req, res, rid, call, skip, latency)
                 for req, res, rid, skip in zip(call.requests, results, call.rids, call.skip_special_tokens)]
        return _json_response(items if call.batched else items[0])

    async def update_weights_from_disk(self, request: Request) -> Response:
        """Load a Hugging Face-format directory's weights and take its weight version, if given; a
        directory that cannot be loaded is a 400 with success false, as in SGLang."""
        path, version = _weights_request(await _json(request))
        try:
            message = await self.state.worker.call(self.state.load_weights, path)
        except BadInput as exc:
            return _json_response({"success": False, "message": f"Failed to update weights: {exc}",
                                   "num_paused_requests": 0}, status_code=400)
        if version is not None:
            self.state.weight_version = version
            message += f". Weight version updated to {version}."
        return _json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def weights_checker(self, request: Request) -> Response:
        """action "checksum" only: every tensor's digest (weights_payload)."""
        body = await _json(request)
        action = body.get("action", "checksum") if isinstance(body, dict) else None
        if action != "checksum":
            return _json_response({"success": False, "message": f"Unsupported action={action!r}: rlbench serve "
                                   "answers action=checksum only"}, status_code=400)
        payload = await self.state.worker.call(weights_payload, self.state)
        return _json_response({"success": True, "message": f"checksum of {len(payload['checksums'])} tensors",
                               "payload": payload})

    async def get_weights_by_name(self, request: Request) -> Response:
        """The first `truncate_size` values of the named parameter, as floats."""
        body = await _json(request)
        name = body.get("name") if isinstance(body, dict) else None
        size = body.get("truncate_size", 100) if isinstance(body, dict) else None
        if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise wire.envelope_error("name (a string) is required; truncate_size is a non-negative integer")
        params = dict(self.state.engine.model.named_parameters())
        if name not in params:
            raise wire.value_error("Get parameter by name failed")
        return _json_response(await self.state.worker.call(lambda: params[name].detach().float().cpu()[:size].tolist()))


async def flush_cache(_request: Request) -> Response:
    """There is no cache between calls: it answers as SGLang does."""
    return Response(content=FLUSHED, status_code=200)


async def refused(_request: Request, exc: wire.RequestError) -> Response:
    """A malformed request (wire.py): a 400 in SGLang's shape."""
    return _json_response(exc.body, status_code=exc.status)


async def http_error(_request: Request, exc: HTTPException) -> Response:
    """404, 405: JSON, as SGLang's FastAPI answers."""
    return _json_response({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def internal(_request: Request, exc: Exception) -> Response:
    """A bug in rlbench serve: said as such, and the server lives on."""
    return _json_response({"error": {"message": f"internal error: {exc.__class__.__name__}: {exc}"}},
                          status_code=500)


def _weights_request(body: Any) -> tuple[str, str | None]:
    """/update_weights_from_disk's model_path and weight_version (a 400 in SGLang's shape when they are not
    a string and a string or null)."""
    path, version = body.get("model_path") if isinstance(body, dict) else None, None
    if isinstance(body, dict) and body.get("weight_version") is not None:
        version = body["weight_version"]
    if not isinstance(path, str) or not isinstance(version, (str, type(None))):
        raise wire.envelope_error("model_path (a string) is required; weight_version is a string or null")
    return path, version


def weights_payload(state) -> dict:
    """SGLang's /weights_checker checksum payload (`checksums` by parameter name, `parallelism_info`),
    with rlbench's checksum (rundir/digest.py, `wire.CHECKSUM_ALGORITHM`), which is what the trainer's side
    computes: each tensor's name, dtype, shape and bytes, under Hugging Face names, reduced on the engine's
    device. SGLang's own server hashes its own parameter
    layout with another function, so the client tells them apart by `algorithm`."""
    from rlbench.core.model import named_weights
    from rlbench.rundir.digest import tensor_digests

    one = {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}
    return {"checksums": tensor_digests(named_weights(state.engine.model)), "parallelism_info": one,
            "algorithm": wire.CHECKSUM_ALGORITHM, "weight_version": state.weight_version}


async def _json(request: Request) -> Any:
    import orjson

    raw = await request.body()
    try:
        return orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError as exc:
        raise wire.envelope_error(f"JSON decode error: {exc}") from None


def _answer(state, req: GenerateRequest, res, rid: str, call: wire.GenerateCall, skip: bool, latency: float) -> dict:
    """One item of SGLang's /generate answer."""
    meta = {"id": rid, "finish_reason": wire.finish_reason(res.output_ids, res.finish_reason, req.stop_token_ids),
            "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(res.output_ids), "cached_tokens": 0,
            "weight_version": state.weight_version, "e2e_latency": latency}
    if call.return_logprob:
        texts = [state.tokenizer.decode([t]) if call.return_text_in_logprobs else None for t in res.output_ids]
        meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(res.logprobs, res.output_ids, texts)]
        meta["output_token_logprobs_length"] = len(res.output_ids)
        meta["input_token_logprobs"] = []
    return {"text": state.tokenizer.decode(list(res.output_ids), skip_special_tokens=skip),
            "output_ids": list(res.output_ids), "meta_info": meta}


def _json_response(content: Any, status_code: int = 200, headers: dict | None = None) -> Response:
    """orjson's bytes (as SGLang answers)."""
    import orjson

    return Response(content=orjson.dumps(content), status_code=status_code, headers=headers,
                    media_type="application/json")
