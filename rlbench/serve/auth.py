"""`rlbench serve --api-key`, as SGLang 0.5.23's add_api_key_middleware does it (srt/utils/auth.py, its NORMAL
level; rlbench serve has no admin key): every request but OPTIONS and paths starting /health, /ready or /metrics
must carry `Authorization: Bearer KEY` (compared in constant time), else 401 {"error": "Unauthorized"}, before its
body is read and before any route runs.
"""

from __future__ import annotations

import secrets

from starlette.responses import Response

OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # SGLang leaves probes and scrapes open
UNAUTHORIZED = Response(b'{"error":"Unauthorized"}', status_code=401, media_type="application/json")  # orjson's bytes


def authorized(method: str, path: str, header: str | None, key: str) -> bool:
    """SGLang's decide_request_auth for a server with an api key and no admin key."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and bool(token) and secrets.compare_digest(token.encode(), key.encode())


class ApiKey:
    """ASGI middleware: a request without the key gets SGLang's 401 and reaches no route."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization")
            header = header.decode("latin-1") if header is not None else None
            if not authorized(scope["method"], scope["path"], header, self.key):
                await UNAUTHORIZED(scope, receive, send)
                return
        await self.app(scope, receive, send)
