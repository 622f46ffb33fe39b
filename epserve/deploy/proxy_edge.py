"""The Serve proxy's own answers in OpenAI's error shape, and bounds on request heads.

Serve's HTTP proxy is uvicorn in the ProxyActor process. It answers some requests before any
replica sees them: uvicorn's plain-text 400 for a request line or header it cannot parse (and
its 500 when the proxy app fails), and the proxy's text errors (404 outside every route
prefix, 408 of ``request_timeout_s``, 429/503 while replicas are busy or starting). uvicorn
bounds neither the time a head takes (its keep-alive timer is armed only after an answer, and
any byte disarms it, so a client that connects and sends nothing, or dribbles, holds a socket
for ever) nor, with httptools, a head's size.

``install`` runs in the proxy process through Serve's hook ``RAY_SERVE_HTTP_PROXY_CALLBACK_
IMPORT_PATH``, an environment variable of the controller's ``runtime_env`` that the proxies
it starts inherit (``serve_start`` sets it; ``controller_options`` gives it for a Serve config).

Invariants: every error the proxy writes itself is ``{"error": {...}}`` JSON; an answer with
a JSON body, or a success, passes through untouched (streams included); a connection whose
request head is not complete within ``$EPSERVE_HEADER_READ_TIMEOUT_S`` of opening or of its
first byte after an answer gets a 408, a head over ``MAX_HEAD_BYTES`` a 431, and is closed;
an idle keep-alive connection keeps uvicorn's own timeout; ``install`` is idempotent, and where
uvicorn lacks what it wraps it logs why and leaves that part as it is. It covers every app
behind the proxy: they share one server.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from typing import Any

from epserve.deploy.errors import ApiError

log = logging.getLogger(__name__)

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
HEADER_TIMEOUT_ENV = "EPSERVE_HEADER_READ_TIMEOUT_S"
DEFAULT_HEADER_READ_TIMEOUT_S = 30.0
_HOOK = f"{__name__}.install"
_MAX_REWRITTEN_BODY = 64 << 10  # the proxy's own messages are one line
#: The most bytes a request line and headers may take (uvicorn's httptools sets no limit).
MAX_HEAD_BYTES = 64 << 10


def controller_options(header_read_timeout_s: float = DEFAULT_HEADER_READ_TIMEOUT_S) -> dict:
    """``serve.start``'s (or a Serve config's) ``controller_options`` that load ``install``
    into every proxy. Serve applies them only when it starts its controller."""
    if not header_read_timeout_s > 0:
        raise ValueError(f"header_read_timeout_s must be > 0, got {header_read_timeout_s!r}")
    return {"runtime_env": {"env_vars": {CALLBACK_ENV: _HOOK,
                                         HEADER_TIMEOUT_ENV: str(float(header_read_timeout_s))}}}


def serve_start(http_options: dict, header_read_timeout_s: float =
                DEFAULT_HEADER_READ_TIMEOUT_S) -> None:
    """``serve.start(http_options=...)`` with this module's proxy edge installed."""
    from ray import serve

    serve.start(http_options=http_options,
                controller_options=controller_options(header_read_timeout_s))


def install() -> list:
    """Serve's proxy callback: patch uvicorn's protocol classes, return the middleware."""
    from starlette.middleware import Middleware

    timeout_s = float(os.environ.get(HEADER_TIMEOUT_ENV) or DEFAULT_HEADER_READ_TIMEOUT_S)
    # uvicorn picks httptools when it is installed (Serve's "auto"), else h11: patch both
    for module, proto in (("httptools_impl", "HttpToolsProtocol"), ("h11_impl", "H11Protocol")):
        try:
            impl = importlib.import_module(f"uvicorn.protocols.http.{module}")
            _patch_protocol(getattr(impl, proto), timeout_s)
            _patch_cycle(impl.RequestResponseCycle)
        except ImportError:  # httptools not installed: uvicorn cannot pick it either
            continue
        except (AttributeError, TypeError) as exc:  # another uvicorn: keep its own answers
            log.warning("epserve: uvicorn's %s is not as expected (%s); its plain-text "
                        "errors and head bounds stay as they are", proto, exc)
    return [Middleware(ProxyErrorsAsJson)]


def error_bytes(status: int, message: str, code: str, extra_headers: list = ()) -> bytes:
    """A whole HTTP/1.1 error answer that closes the connection."""
    from http import HTTPStatus

    body = json.dumps(ApiError(status, message, code=code).body()).encode()
    head = [b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())]
    head += [name + b": " + value + b"\r\n" for name, value in extra_headers]
    head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
             b"connection: close\r\n\r\n"]
    return b"".join(head) + body


def _write_error_and_close(proto: Any, status: int, message: str, code: str) -> None:
    if proto.transport.is_closing():
        return
    defaults = getattr(getattr(proto, "server_state", None), "default_headers", [])
    proto.transport.write(error_bytes(status, message, code, defaults))
    proto.transport.close()


def _patch_protocol(cls: type, timeout_s: float) -> None:
    """JSON for uvicorn's 400; the head deadline and size cap around its protocol callbacks."""
    if getattr(cls, "_epserve_edge", False):
        return
    made, received, lost = cls.connection_made, cls.data_received, cls.connection_lost
    cls.send_400_response  # AttributeError before anything is patched
    begin = getattr(cls, "on_message_begin", None)  # httptools only; h11 caps heads itself
    on_url, on_header = getattr(cls, "on_url", None), getattr(cls, "on_header", None)

    def connection_made(self: Any, transport: Any) -> None:
        made(self, transport)
        _arm(self)  # a client that connects and sends nothing holds a socket otherwise

    def data_received(self: Any, data: bytes) -> None:
        # Armed from the first byte after an answer (uvicorn's keep-alive timer is disarmed
        # by any byte) until uvicorn starts a new cycle, i.e. has parsed a whole head.
        if self._epserve_head_timer is None and _between_requests(self):
            _arm(self)
        received(self, data)
        if self.cycle is not self._epserve_head_cycle:
            _disarm(self)
        elif self._epserve_head_began and not self.transport.is_closing():
            self._epserve_head_bytes += len(data)  # httptools buffers a head without bound
            if self._epserve_head_bytes > MAX_HEAD_BYTES:
                _disarm(self)
                _write_error_and_close(self, 431, f"the request line and headers are longer "
                                       f"than {MAX_HEAD_BYTES} bytes", "request_too_large")

    def on_message_begin(self: Any) -> None:
        self._epserve_head_began = True
        self._epserve_head_parsed = 0
        begin(self)

    # A head that arrives whole in one read is parsed inside that read, so the byte count
    # above never sees it unfinished: the parser's own callbacks count it too. Raising here
    # makes the parser fail the request, and uvicorn's 400 answer becomes the 431.
    def counted_url(self: Any, url: bytes) -> None:
        _count_head(self, len(url))
        on_url(self, url)

    def counted_header(self: Any, name: bytes, value: bytes) -> None:
        _count_head(self, len(name) + len(value) + 4)
        on_header(self, name, value)

    def connection_lost(self: Any, exc: Exception | None) -> None:
        _disarm(self)
        lost(self, exc)

    cls.send_400_response = _send_400_response
    cls.connection_made, cls.data_received = connection_made, data_received
    cls.connection_lost = connection_lost
    if begin is not None:
        cls.on_message_begin = on_message_begin
    if on_url is not None and on_header is not None:
        cls.on_url, cls.on_header = counted_url, counted_header
    cls._epserve_head_parsed, cls._epserve_head_too_large = 0, False
    cls._epserve_timeout_s = timeout_s
    cls._epserve_head_timer = cls._epserve_head_cycle = None
    cls._epserve_head_bytes, cls._epserve_head_began = 0, False
    cls._epserve_edge = True


def _count_head(proto: Any, n: int) -> None:
    proto._epserve_head_parsed += n
    if proto._epserve_head_parsed > MAX_HEAD_BYTES:
        proto._epserve_head_too_large = True
        raise ValueError("request head too large")


def _send_400_response(proto: Any, msg: str) -> None:
    if proto._epserve_head_too_large:
        _disarm(proto)
        _write_error_and_close(proto, 431, f"the request line and headers are longer than "
                               f"{MAX_HEAD_BYTES} bytes", "request_too_large")
        return
    _write_error_and_close(proto, 400, f"the server could not parse the HTTP request: {msg}",
                           "invalid_http_request")


def _between_requests(proto: Any) -> bool:
    return proto.cycle is None or proto.cycle.response_complete


def _arm(proto: Any) -> None:
    proto._epserve_head_cycle = proto.cycle
    proto._epserve_head_bytes, proto._epserve_head_began = 0, False
    proto._epserve_head_timer = proto.loop.call_later(proto._epserve_timeout_s,
                                                      _head_timeout, proto)


def _disarm(proto: Any) -> None:
    if proto._epserve_head_timer is not None:
        proto._epserve_head_timer.cancel()
        proto._epserve_head_timer = None


def _head_timeout(proto: Any) -> None:
    proto._epserve_head_timer = None
    if _between_requests(proto):  # never cut an answer under way
        _write_error_and_close(proto, 408, f"the request line and headers were not received "
                               f"within {proto._epserve_timeout_s:g} s", "request_timeout")


def _patch_cycle(cls: type) -> None:
    """JSON for uvicorn's 500 (an exception in the proxy app before it answered)."""
    if getattr(cls, "_epserve_edge", False):
        return
    cls.send_500_response  # AttributeError before anything is patched

    async def send_500_response(self: Any) -> None:
        body = json.dumps(ApiError(500, "internal server error",
                                   code="internal_error").body()).encode()
        await self.send({"type": "http.response.start", "status": 500, "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
            (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    cls.send_500_response = send_500_response
    cls._epserve_edge = True


class ProxyErrorsAsJson:
    """ASGI middleware in the proxy: an error answer whose body is not JSON (the proxy's own
    text errors) is answered again as OpenAI's error JSON with the same status and the text as
    its message; everything else passes through as sent."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: dict[str, Any] = {}

        async def send_json_errors(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400 \
                    and not _is_json(message.get("headers", [])):
                held["start"], held["body"] = message, b""
                return
            if message["type"] != "http.response.body" or "start" not in held:
                return await send(message)
            held["body"] += message.get("body", b"")
            if message.get("more_body", False) and len(held["body"]) <= _MAX_REWRITTEN_BODY:
                return
            start, text = held.pop("start"), held.pop("body")
            await _send_as_json(send, start, text, message.get("more_body", False))

        await self.app(scope, receive, send_json_errors)


def _is_json(headers: list) -> bool:
    for name, value in headers:
        if bytes(name).lower() == b"content-type":
            return bytes(value).split(b";")[0].strip().lower() == b"application/json"
    return False


async def _send_as_json(send: Any, start: dict, text: bytes, more: bool) -> None:
    if more:  # a long body is not one of the proxy's messages: pass it on as it was
        await send(start)
        await send({"type": "http.response.body", "body": text, "more_body": True})
        return
    status = start["status"]
    message = text.decode("utf-8", "replace").strip() or f"HTTP {status}"
    body = json.dumps(ApiError(status, message).body()).encode()
    keep = [(bytes(n), bytes(v)) for n, v in start.get("headers", [])
            if bytes(n).lower() not in (b"content-type", b"content-length")]
    await send({**start, "headers": keep + [(b"content-type", b"application/json"),
                                            (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
