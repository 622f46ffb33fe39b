"""The ingress's gate: the API key on every route but the health probes, and a JSON body's
media type, size and read deadline.

Invariants: with a key configured, every path but ``OPEN_PATHS`` (the API, /metrics, the docs
and /openapi.json, unknown paths alike) answers 401 in OpenAI's shape unless the request's
``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's header) matches, compared
in constant time on the header's raw bytes, before any route runs; without a key every path
is open (under /v1/messages a 401 is in Anthropic's shape: ``anthropic_api``). A JSON route
reads its body only when its Content-Type is application/json (415 otherwise, naming what was
sent: a browser's CORS "simple request" cannot send that type without a preflight), at most
``max_body_bytes`` (413), and within ``body_read_timeout_s`` of the handler's start (408, and
the connection is closed).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi.responses import JSONResponse

from epserve.deploy.errors import ApiError, parse_json_object, read_body

#: Paths answered without the key: load balancers probe /health with no credentials, and
#: SageMaker /ping (vLLM's /ping is /health under SageMaker's name; vLLM leaves both open).
OPEN_PATHS = frozenset({"/health", "/ping"})
JSON_MEDIA_TYPE = "application/json"


def error_response(exc: ApiError) -> JSONResponse:
    """``exc`` as OpenAI's error JSON; a 408's connection is closed (its body is unread)."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else \
        {"Connection": "close"} if exc.status == 408 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect or missing API key. Send it as the header "
                    "'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                    code="invalid_api_key")


class Gate:
    """Auth and body limits of one ingress (``api_key`` as ``AppConfig`` resolved it)."""

    def __init__(self, api_key: str | None, max_body_bytes: int,
                 body_read_timeout_s: float):
        key = api_key.strip() if api_key else None
        self._key = key.encode("utf-8") if key else None
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s

    def needs_key(self, path: str) -> bool:
        return self._key is not None and path not in OPEN_PATHS

    def authorized(self, authorization: bytes, x_api_key: bytes = b"") -> bool:
        """Whether the raw ``Authorization`` or ``x-api-key`` header value carries the key."""
        scheme, _, token = authorization.partition(b" ")
        given = token.strip() if scheme.lower() == b"bearer" else b""
        # Constant time in the key's content: compare_digest on bytes, as sent (no decoding,
        # so a non-ASCII key matches its UTF-8 bytes); both compared whichever matches.
        bearer = hmac.compare_digest(given, self._key or b"")
        return bearer | hmac.compare_digest(x_api_key.strip(), self._key or b"")

    async def json(self, request: Any) -> dict[str, Any]:
        """The body of a JSON route, as a JSON object, within the limits."""
        check_json_content_type(request.headers.get("content-type"))
        try:
            async with asyncio.timeout(self.body_read_timeout_s):
                raw = await read_body(request, self.max_body_bytes)
        except TimeoutError:
            raise ApiError(408, f"the request body was not received within "
                           f"{self.body_read_timeout_s:g} s", code="request_timeout") from None
        return parse_json_object(raw)


def check_json_content_type(content_type: str | None) -> None:
    """415 unless the media type is application/json (parameters such as charset allowed)."""
    if content_type is None:
        raise ApiError(415, f"the request has no Content-Type header; send "
                       f"'Content-Type: {JSON_MEDIA_TYPE}'", code="unsupported_media_type")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        raise ApiError(415, f"Content-Type must be {JSON_MEDIA_TYPE}, got "
                       f"{content_type[:100]!r}", code="unsupported_media_type")


class AuthMiddleware:
    """Pure ASGI (receive and send pass through untouched, so a client's disconnect still
    reaches the routes): the key check in front of every route, docs and 404s included."""

    def __init__(self, app: Any, gate: Gate):
        self.app = app
        self.gate = gate

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.gate.needs_key(app_path(scope)):
            if not self.gate.authorized(_header(scope, b"authorization"),
                                        _header(scope, b"x-api-key")):
                return await error_response(unauthorized())(scope, receive, send)
        await self.app(scope, receive, send)


def _header(scope: dict, name: bytes) -> bytes:
    """The first value of header ``name`` (ASGI names are lower-case), or b""."""
    return next((v for k, v in scope["headers"] if k == name), b"")


def app_path(scope: dict) -> str:
    """The path the app routes on (Serve may mount it under a route prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "").rstrip("/")
    return path[len(root):] if root and path.startswith(root) else path
