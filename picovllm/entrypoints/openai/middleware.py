"""Two plain ASGI middlewares: a bearer-token check on /v1 and a request-body size limit. Each tells `refused`, if
given, of a request it answers with an error itself (scope, status): the server's metrics count it as the app's own
refusals are counted."""
from __future__ import annotations

import hmac
import json
from typing import Callable

from fastapi import HTTPException

from picovllm.entrypoints.openai.protocol import error_body


async def send_error(send, status: int, message: str, type: str = "invalid_request_error") -> None:
    body = json.dumps(error_body(message, type)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


Refused = Callable[[dict, int], None]


async def refuse(scope, send, refused: Refused | None, status: int, message: str,
                 type: str = "invalid_request_error") -> None:
    if refused is not None:
        refused(scope, status)
    await send_error(send, status, message, type)


def route_path(scope) -> str:
    """The path the app routes: uvicorn's path holds the root path (--root-path) in front, which Starlette's routing
    takes off (a path without it is routed as it is)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


class APIKeyAuth:
    """Every /v1 route needs `Authorization: Bearer <key>`, the key one of api_key's (vLLM's --api-key takes
    several); /health and /metrics stay open."""

    def __init__(self, app, api_key: str | tuple[str, ...], refused: Refused | None = None) -> None:
        self.app, self.refused = app, refused
        keys = (api_key,) if isinstance(api_key, str) else api_key
        self.expected = [f"Bearer {key}".encode() for key in keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and route_path(scope).startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not any([hmac.compare_digest(got, key) for key in self.expected]):     # each compared: no early out
                return await refuse(scope, send, self.refused, 401,
                                    "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")
        await self.app(scope, receive, send)


class BodySizeLimit:
    """Refuse bodies over max_bytes with 413: by Content-Length up front, or while a chunked body streams in."""

    def __init__(self, app, max_bytes: int, refused: Refused | None = None) -> None:
        self.app, self.refused = app, refused
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await refuse(scope, send, self.refused, 400, "Content-Length header is not a number")
            if int(length) > self.max_bytes:
                return await refuse(scope, send, self.refused, 413, self._message())
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._message())   # FastAPI's body reader re-raises these
            return msg

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body is larger than the server's limit of {self.max_bytes} bytes"
