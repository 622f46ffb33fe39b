"""The Ray Serve application: ``build_app(config)`` and its FastAPI ingress deployment.

Invariants: every answer that is not a success is OpenAI's error JSON (unknown routes and
methods included, and any unexpected exception, which is logged and answered 500 without
internals); every path but /health and /ping needs the API key when one is set (``gate``;
vLLM's endpoints beside the API are ``vllm_routes``), and a body is read only
as application/json, within ``max_body_bytes`` and ``body_read_timeout_s`` (``gate``), and
parsed with bounded depth before any model is built from it; pydantic stays at this edge —
the engine gets plain values.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping

from fastapi import FastAPI, Request
from ray import serve
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import epserve
from epserve.deploy.anthropic_api import add_anthropic_routes
from epserve.deploy.config import AppConfig
from epserve.deploy.errors import ApiError
from epserve.deploy.gate import AuthMiddleware, Gate, error_response
from epserve.deploy.metrics import CONTENT_TYPE, ServerMetrics
from epserve.deploy.responses_api import add_responses_routes
from epserve.deploy.serving import ModelInfo, OpenAIServing
from epserve.deploy.vllm_routes import LoadTracker, ServerLoad, add_vllm_routes, health_response
from epserve.head.limits import RequestLimits

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def make_fastapi_app(serving: OpenAIServing, gate: Gate) -> FastAPI:
    """The OpenAI routes over ``serving``; usable without Ray Serve (e.g. under uvicorn)."""
    app = FastAPI(title="epserve", summary="OpenAI-compatible API of an epserve engine",
                  version=epserve.__version__)
    _install_error_handlers(app)
    load = ServerLoad()  # /load: this replica's engine requests in flight
    app.add_middleware(LoadTracker, load=load)  # inside the gate: a refused key is no load
    app.add_middleware(AuthMiddleware, gate=gate)  # outermost: before docs pages and 404s

    def _respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return _respond(await serving.completions(await gate.json(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return _respond(await serving.chat(await gate.json(request)))

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(serving.models())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return JSONResponse(await serving.tokenize(await gate.json(request)))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return JSONResponse(await serving.detokenize(await gate.json(request)))

    @app.get("/health")
    async def health() -> Response:
        return await health_response(serving.client.health)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await serving.client.stats()
        return Response(serving.metrics.render(stats), media_type=CONTENT_TYPE)

    add_vllm_routes(app, serving, load)  # /version, /ping, /load, /tokenizer_info
    add_anthropic_routes(app, serving, gate, _respond)  # /v1/messages, Anthropic's errors
    add_responses_routes(app, serving, gate, _respond)  # /v1/responses (not stored)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(ApiError(400, str(exc.errors()[:1])))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error in a request")
        return error_response(ApiError(500, "internal server error", code="internal_error"))


async def connect(config: AppConfig) -> tuple[OpenAIServing, Gate]:
    """Start (or find) the head for ``config``, load the tokenizer, and build the serving
    object and gate. Runs in the ingress process."""
    from epserve.cluster.bringup import start_head
    from epserve.cluster.engine_args import load_tokenizer
    from epserve.deploy.engine_client import EngineClient

    args = config.engine_args()
    local = await asyncio.to_thread(args.resolved)  # builds the demo model here if needed
    head = await asyncio.to_thread(start_head, local, config.head_name)
    client = EngineClient(head)
    facts = await client.ready()
    if facts["model"] != local.model:
        raise ValueError(f"the engine named {config.head_name!r} already serves "
                         f"{facts['model']!r}, not {local.model!r}; stop it or pick another "
                         f"head_name")
    tokenizer = await asyncio.to_thread(load_tokenizer, local.model, local.tokenizer)
    # logprob dicts are built here, in the ingress, with the token texts decoded here
    client.decode = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) \
        if tokenizer is not None else (lambda t: "")
    info = ModelInfo(name=str(facts["served_model_name"]), path=str(facts["model"]),
                     max_model_len=int(facts["max_model_len"]),
                     vocab_size=int(facts["vocab_size"]),
                     limits=RequestLimits(**facts["limits"]),
                     prefix_caching=facts["cache_config"]["enable_prefix_caching"] == "True")
    serving = OpenAIServing(client, tokenizer, info,
                            ServerMetrics(info.name, facts["cache_config"], info.max_model_len),
                            config.chat_parsing(), config.return_tokens_as_token_ids)
    return serving, Gate(config.resolved_api_key(), config.max_body_bytes,
                         config.body_read_timeout_s)


# graceful_shutdown_wait_loop_s: a stopping replica sleeps this long before it first counts its
# requests in flight (Serve's default 2 s, even with none), so Ctrl-C of `epserve serve` and
# `serve run` waited 2 s more than needed; in-flight requests are still drained (up to
# graceful_shutdown_timeout_s, Serve's default 20 s), counted every 0.5 s.
# The routes run on the replica's own event loop (USER_CODE_ENV, as Serve's
# RAY_SERVE_THROUGHPUT_OPTIMIZED sets it), not on a second loop in a thread of their own: every
# streamed chunk otherwise crosses threads to reach the replica's HTTP server (behind HAProxy,
# 93-95 -> 75 us of replica CPU a chunk, bench/RESULTS.md session 20). Nothing in them
# blocks: the engine is another actor, reached by awaited calls.
USER_CODE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


@serve.deployment(name="OpenAIIngress",
                  ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": USER_CODE_ENV}},
                  health_check_period_s=10, health_check_timeout_s=30,
                  graceful_shutdown_wait_loop_s=0.5)
@serve.ingress()
class OpenAIIngress:
    """The HTTP edge, one per replica; every replica reaches the same named head."""

    async def __init__(self, config: dict[str, Any]):
        from epserve.cluster.cpu_threads import freeze_heap, normal_priority

        normal_priority()  # the HTTP path is latency-bound: not below the clients it serves
        self.config = AppConfig.from_dict(config)
        self.serving, self.gate = await connect(self.config)
        freeze_heap()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return make_fastapi_app(self.serving, self.gate)


def build_app(config: Mapping[str, Any] | AppConfig | None = None) -> Any:
    """The Serve application for ``config`` (serve.yaml's ``args``, flat: engine options as
    ``EngineArgs`` names them, plus ``api_key``, ``max_body_bytes``, ``body_read_timeout_s``,
    ``head_name``, ``num_replicas``, ``max_ongoing_requests``). Nothing loads until a replica
    starts."""
    cfg = config if isinstance(config, AppConfig) else AppConfig.from_dict(config)
    return OpenAIIngress.options(
        num_replicas=cfg.num_replicas, max_ongoing_requests=cfg.max_ongoing_requests,
    ).bind(cfg.to_dict())
