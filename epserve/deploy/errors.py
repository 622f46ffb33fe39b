"""OpenAI's error JSON, and reading a request body within the edge's limits.

Invariants: every error the server answers is ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status for anything the client sent (never a 500 for bad input); a body
is read at most ``max_bytes`` (+ one chunk) before a 413; a parsed body is a JSON object no
deeper than ``MAX_JSON_DEPTH``, with no NaN/Infinity and no lone surrogates in any string.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_JSON_DEPTH = 32

# OpenAI's ``type`` by status; any other 4xx is an invalid request, any other 5xx server_error
_TYPES = {500: "server_error", 503: "service_unavailable"}

_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


class ApiError(Exception):
    """An answer in OpenAI's error shape; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_value_error(exc: BaseException, default_param: str | None = None) -> ApiError:
    """A 400 for a ``ValueError`` of SamplingParams or the engine; ``param`` is the field its
    message names (``SamplingParams.top_p must ...`` -> ``top_p``)."""
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the original exception
    msg = str(cause if isinstance(cause, BaseException) else exc)
    m = _FIELD_IN_MESSAGE.search(msg)
    param = m.group(1) if m else default_param
    if msg.startswith("prompt_token_ids:") or msg.startswith("prompt:"):
        param = default_param or "prompt"
    return bad_request(msg, param=param)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_PLAIN = (int, bool, type(None))  # JSON values a body check has nothing to look at in


def check_json(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Walk a parsed body without recursion: bounded depth, valid Unicode strings, finite
    numbers. Members that need no check (ints, booleans, nulls) are not pushed: a container
    whose members would lie deeper than ``max_depth`` is refused as it is reached, so a prompt
    of token ids costs one type test an id, not a stack entry."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > max_depth:
            raise _too_deep(max_depth)
        if isinstance(v, str):
            _check_str(v)
        elif isinstance(v, float) and not math.isfinite(v):
            raise bad_request("the JSON body holds a number too large for a float")
        elif isinstance(v, dict):
            if v and depth >= max_depth:
                raise _too_deep(max_depth)
            for k, item in v.items():
                _check_str(k)
                if type(item) not in _PLAIN:
                    stack.append((item, depth + 1))
        elif isinstance(v, list):
            if v and depth >= max_depth:
                raise _too_deep(max_depth)
            stack.extend([(item, depth + 1) for item in v if type(item) not in _PLAIN])


def _too_deep(max_depth: int) -> ApiError:
    return bad_request(f"the JSON body is nested deeper than {max_depth} levels")


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the JSON body holds a string that is not valid Unicode "
                          "(a lone surrogate escape)") from None


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what is wrong with it."""
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError:
        raise bad_request("the request body is not valid UTF-8") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, a number too long to read
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(value).__name__}")
    check_json(value)
    return value


async def read_body(request: Any, max_bytes: int) -> bytes:
    """The raw body of a Starlette ``request``; 413 past ``max_bytes`` (declared or sent)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise bad_request("the Content-Length header is not a number") from None
        if n > max_bytes:
            raise too_large(max_bytes)
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > max_bytes:
            raise too_large(max_bytes)
    return bytes(buf)


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {max_bytes} bytes",
                    code="request_too_large")
