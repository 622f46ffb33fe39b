"""vLLM's operational endpoints beside the OpenAI API: /version, /ping, /load, /tokenizer_info.

Invariants: /ping (GET and POST, SageMaker's probe) answers exactly as /health does: 200 with
an empty body, or 503 in OpenAI's error shape. /load is ``{"server_load": N}``, N the engine
requests (every POST under /v1/) this ingress replica has in flight, each counted from the
moment it passes the gate until its response's last byte is sent, its client is gone or it
failed — so it returns to 0 whatever way the requests end. /version is
``{"version": epserve.__version__}``. /tokenizer_info is the tokenizer's configuration as vLLM
builds it (the tokenizer's init kwargs without file paths, added tokens as their text, plus
``tokenizer_class`` and the chat template), JSON-serializable, built once; a model that has no
tokenizer answers a 400 saying so.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

import epserve
from epserve.deploy.errors import ApiError, bad_request
from epserve.deploy.gate import app_path, error_response

#: init kwargs that name the tokenizer's files on this machine, not its configuration
_FILE_KEYS = frozenset({"vocab_file", "merges_file", "tokenizer_file"})


class ServerLoad:
    """The number of engine requests in flight on this replica (one event loop: no lock)."""

    def __init__(self) -> None:
        self.in_flight = 0


def is_engine_request(scope: dict) -> bool:
    """A request the engine serves: a POST under /v1/ (completions, chat, and the like)."""
    return scope.get("method") == "POST" and app_path(scope).startswith("/v1/")


class LoadTracker:
    """Pure ASGI, inside the gate (a refused key is not load): counts engine requests while
    the app runs them — for a stream, until its last chunk is sent or its client leaves."""

    def __init__(self, app: Any, load: ServerLoad):
        self.app = app
        self.load = load

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_engine_request(scope):
            return await self.app(scope, receive, send)
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


def _jsonable(value: Any) -> Any:
    """``value`` as JSON: a special token (``AddedToken``) as its text, mapping keys as
    strings, sequences as lists, anything else unknown as its ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    content = getattr(value, "content", None)
    if isinstance(content, str):
        return content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return str(value)


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's /tokenizer_info body for a Hugging Face tokenizer."""
    config = {k: _jsonable(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in _FILE_KEYS}
    config["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = _jsonable(template)
    return config


async def health_response(health: Callable[[], Any]) -> Response:
    """/health's answer from ``health()`` -> (ok, reason)."""
    ok, reason = await health()
    if ok:
        return Response(status_code=200)
    return error_response(ApiError(503, f"unhealthy: {reason}", code="engine_unavailable"))


def add_vllm_routes(app: FastAPI, serving: Any, load: ServerLoad) -> None:
    """The routes over ``serving`` (``OpenAIServing``); ``load`` is the replica's counter."""
    info: list[dict[str, Any]] = []  # /tokenizer_info's body, built on first use

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": epserve.__version__})

    @app.get("/ping")
    async def ping() -> Response:
        return await health_response(serving.client.health)

    @app.post("/ping")  # SageMaker's probe is a POST; vLLM answers both
    async def ping_post() -> Response:
        return await health_response(serving.client.health)

    @app.get("/load")
    async def server_load() -> Response:
        return JSONResponse({"server_load": load.in_flight})

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> Response:
        if serving.tokenizer is None:
            raise bad_request("this model has no tokenizer (its folder ships none), so there "
                              "is no tokenizer configuration to show; serve it with "
                              "--tokenizer PATH to give it one")
        if not info:
            info.append(tokenizer_info(serving.tokenizer))
        return JSONResponse(info[0])
