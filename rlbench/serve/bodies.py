"""What `rlbench serve`'s routes share about bodies: a request body's JSON read and its fields held to their
kinds (SGLang's 400 answers), the paths weights may be read from, and the answers' JSON, events and update
replies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from starlette.responses import Response

from rlbench.serve import request_gates as gates


def no_text(_text: str) -> list[int]:
    raise gates.value(
        "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide "
        "input_ids or re-initialize the engine with skip_tokenizer_init=False."
    )


def outside_root(path: str, root: Path | None) -> str | None:
    """Why `path` may not be read (it is not below `root`, symbolic links followed), or None; a server
    without a root (ServeConfig.weights_root) reads any path, as SGLang's does."""
    if root is None:
        return None
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        return f"Failed to get weights iterator: {exc.__class__.__name__}: {str(exc)[:200]}."
    if resolved == root or root in resolved.parents:
        return None
    return (
        f"Failed to update weights: {path} is outside the directory this server reads weights from ({root}; "
        f"rlbench serve --weights-dir). Nothing was changed."
    )


def update_answer(success: bool, message: str) -> Response:
    return json_response(
        {"success": success, "message": message, "num_paused_requests": 0}, status_code=200 if success else 400
    )


def body_fields(body: Any, kinds: dict[str, Any], required: tuple[str, ...] = ()) -> dict:
    """A control request's body as its SGLang struct takes it: an object, the fields it declares of their
    types (unknown fields ignored), the required ones present; else the pydantic envelope."""
    if not isinstance(body, dict):
        raise gates.pydantic_error("", "model_type", "Input should be an object", body)
    for name in required:
        if name not in body:
            raise gates.pydantic_error(name, "missing", "Field required", body)
    for name, kind in kinds.items():
        if name in body:
            ok = isinstance(body[name], kind) and not (isinstance(body[name], bool) and kind is int)
            if not ok:
                raise gates.pydantic_error(name, "type_error", f"Input should be {kind_name(kind)}", body[name])
    return body


def kind_name(kind: Any) -> str:
    names = {
        str: "a valid string",
        bool: "a valid boolean",
        int: "a valid integer",
        dict: "a valid dictionary",
        list: "a valid list",
    }
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, "null") for k in kinds)


def loads_body(raw: bytes, route: str) -> Any:
    """JSON as SGLang 0.5.23 reads every body (its ORJSONRequest): orjson, which refuses what Python's json
    would take (a UTF-8 byte-order mark, NaN, Infinity; an integer past 64 bits becomes a float), with
    FastAPI's 400 for it."""
    import orjson

    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise gates.json_invalid(exc.pos, exc.msg, route) from None


def sse_event(obj: Any) -> bytes:
    import orjson

    return b"data: " + orjson.dumps(obj) + b"\n\n"


def json_response(content: Any, status_code: int = 200, headers: dict | None = None) -> Response:
    """orjson's bytes (as SGLang answers); Python's json where orjson cannot (an integer past 64 bits)."""
    import orjson

    try:
        raw = orjson.dumps(content)
    except TypeError:
        raw = json.dumps(content).encode()
    return Response(content=raw, status_code=status_code, headers=headers, media_type="application/json")
