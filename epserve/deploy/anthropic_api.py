"""Anthropic's Messages API over the chat path: POST /v1/messages (whole or streamed) and
/v1/messages/count_tokens, and every error under /v1/messages in Anthropic's shape.

Invariants: a message request is parsed and checked here (``anthropic_models``), then served
by ``OpenAIServing.chat`` as the chat body it translates to — the template, the checks, the
engine and the metrics are the chat path's, and so are a stream's deltas — and its answer is
reshaped: a body to Anthropic's ``message``; a stream to Anthropic's events (``message_start``,
``ping``, then per content block ``content_block_start``, ``content_block_delta``...,
``content_block_stop``, then ``message_delta`` with the stop reason and the final usage,
``message_stop``), each with its ``event:`` line, the same blocks as the whole answer's (the
reasoning a ``--reasoning-parser`` splits off as a ``thinking`` block, then the text, then a
``tool_use`` block per tool call the chat path parsed: ``input`` its arguments' JSON value,
streamed as ``input_json_delta`` pieces after a start with ``input: {}``; ``stop_reason``
``tool_use`` whenever a call came back, forced ones too), an error after the 200 as one
``error`` event that ends the stream. What the chat path refuses of a field this layer made
(``tool_choice``, ``chat_template_kwargs`` from ``thinking``, a tool's ``input_schema``) is
said in the request's terms; ``thinking`` enabled needs a reasoning parser (else no thinking
block could come back), and thinking blocks in the history a template that renders
reasoning (else they would be dropped). Closing the reshaped stream closes the chat stream
(its engine request is aborted). Every error answered under /v1/messages — the gate's
401/413/415, a route's 400/404, an unknown sub-path, an unexpected exception — is
``{"type": "error", "error": {"type", "message"}}`` with the error type Anthropic gives that
status, its message naming the field by Anthropic's name.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from epserve.deploy.anthropic_blocks import to_anthropic_id
from epserve.deploy.anthropic_models import (
    CountTokensRequest, MessagesRequest, check_cache_control, parse,
)
from epserve.deploy.errors import ApiError, bad_request
from epserve.deploy.gate import Gate, app_path
from epserve.deploy.stream import chat_chunks

log = logging.getLogger(__name__)

PREFIX = "/v1/messages"
#: The chat body's field -> the Anthropic request field it came from.
_ANTHROPIC_NAME = {"stop": "stop_sequences", "user": "metadata"}
#: Anthropic's error type by HTTP status (any other 4xx is an invalid request, 5xx api_error).
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
#: In a stream no status travels: the chat path's error type -> Anthropic's.
_STREAM_ERROR_TYPES = {"invalid_request_error": "invalid_request_error",
                       "service_unavailable": "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _message(err: dict[str, Any]) -> str:
    """An OpenAI-shaped error's message, its field in front when it does not name it."""
    message, param = str(err.get("message") or "error"), err.get("param")
    param = _ANTHROPIC_NAME.get(param, param)
    return message if not param or message.startswith(param) else f"{param}: {message}"


# ---------------------------------------------------------------------- bodies


def _stop(finish_reason: str | None, stop_reason: Any) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str):  # the stop string that ended it (vLLM's stop_reason)
        return "stop_sequence", stop_reason
    return "end_turn", None  # EOS or a stop token id


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens computed for this request,
    ``cache_read_input_tokens`` those whose KV the prefix cache held (their sum is the
    prompt)."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": chat_usage["prompt_tokens"] - cached,
            "output_tokens": chat_usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _shell(chat: dict[str, Any]) -> dict[str, Any]:
    """The message's fields but content, stop and usage, from a chat body or chunk."""
    return {"id": "msg_" + str(chat["id"]).split("-", 1)[-1], "type": "message",
            "role": "assistant", "model": chat["model"]}


def _reasoning(message: dict[str, Any]) -> str:
    """A chat message's or delta's reasoning (the server's ``--reasoning-parser`` splits it
    off the content; vLLM names it twice)."""
    return message.get("reasoning_content") or message.get("reasoning") or ""


def _block(kind: str, text: str) -> dict[str, Any]:
    """A content block: ``text``, or ``thinking`` (the model's reasoning; unsigned)."""
    if kind == "thinking":
        return {"type": "thinking", "thinking": text, "signature": ""}
    return {"type": "text", "text": text}


def _tool_use(call_id: str, name: str, args: Any) -> dict[str, Any]:
    """A chat tool call as a ``tool_use`` block (``args``: its arguments as a JSON value)."""
    return {"type": "tool_use", "id": to_anthropic_id(call_id), "name": name, "input": args}


def _input(arguments: str) -> Any:
    """A call's arguments as ``input``: their JSON value (an object when the model followed
    the schema; a model that wrote a string holding no JSON gets that text, not a 500)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def message_body(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (n = 1) as Anthropic's message: its reasoning as a thinking block,
    then its text (a text block always, unless there is reasoning or a call and no text),
    then a ``tool_use`` block per tool call (its arguments' JSON as ``input``)."""
    choice = chat["choices"][0]
    reason, sequence = _stop(choice["finish_reason"], choice.get("stop_reason"))
    message = choice["message"]
    thought, text = _reasoning(message), message.get("content") or ""
    calls = [_tool_use(c["id"], c["function"]["name"], _input(c["function"]["arguments"]))
             for c in message.get("tool_calls") or ()]
    reason = "tool_use" if calls and reason == "end_turn" else reason  # a forced named call
    content = ([_block("thinking", thought)] if thought else []) + \
        ([_block("text", text)] if text or not (thought or calls) else []) + calls
    return {**_shell(chat), "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(chat["usage"])}


def event(obj: dict[str, Any]) -> str:
    """One server-sent event as Anthropic sends it: its type as the event name."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {obj['type']}\ndata: {data}\n\n"


class _Blocks:
    """A streamed message's content blocks: a block opens when a delta of its kind (a tool
    call: of its index) arrives after one of another (the previous one is closed), so their
    order and indices are the whole message's."""

    def __init__(self) -> None:
        self.index, self.key, self.opened = -1, None, False

    def _open(self, key: Any, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index, self.key, self.opened = self.index + 1, key, True
        out.append(event({"type": "content_block_start", "index": self.index,
                          "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def delta(self, kind: str, text: str) -> list[str]:
        out = self._open(kind, _block(kind, "")) if kind != self.key else []
        if text:
            out.append(self._delta({"type": f"{kind}_delta", kind: text}))
        return out

    def tool_call(self, call: dict[str, Any]) -> list[str]:
        """A chat ``delta.tool_calls`` entry: a call's first (id and name) opens its
        ``tool_use`` block, its argument pieces are ``input_json_delta``s."""
        key = ("tool", call["index"])
        fn = call.get("function") or {}
        out = self._open(key, _tool_use(call["id"], fn["name"], {})) if key != self.key else []
        if fn.get("arguments"):
            out.append(self._delta({"type": "input_json_delta",
                                    "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[str]:
        if self.key is None:
            return []
        self.key = None
        return [event({"type": "content_block_stop", "index": self.index})]


async def message_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The chat stream (``data:`` chunks with usage in each, then ``[DONE]``) as Anthropic's
    events: the same content blocks as ``message_body`` of the whole answer."""
    blocks, started, last_usage, finish = _Blocks(), False, None, (None, None)
    called = False
    async with contextlib.aclosing(chat_chunks(chunks)) as read:
        async for chunk in read:
            if "error" in chunk:
                err = chunk["error"]
                kind = _STREAM_ERROR_TYPES.get(err.get("type"), "api_error")
                yield event(error_body(kind, _message(err)))
                return
            last_usage = chunk.get("usage") or last_usage
            if not started:  # the opening chunk
                started = True
                yield event({"type": "message_start", "message": {
                    **_shell(chunk), "content": [], "stop_reason": None,
                    "stop_sequence": None, "usage": usage(last_usage)}})
                yield event({"type": "ping"})
            for choice in chunk["choices"]:
                for kind, text in (("thinking", _reasoning(choice["delta"])),
                                   ("text", choice["delta"].get("content"))):
                    for e in blocks.delta(kind, text) if text else ():
                        yield e
                for call in choice["delta"].get("tool_calls") or ():
                    called = True
                    for e in blocks.tool_call(call):
                        yield e
                if choice.get("finish_reason"):
                    finish = (choice["finish_reason"], choice.get("stop_reason"))
    if not blocks.opened:  # no text at all: one empty text block, as the whole message has
        for e in blocks.delta("text", ""):
            yield e
    for e in blocks.close():
        yield e
    reason, sequence = _stop(*finish)
    reason = "tool_use" if called and reason == "end_turn" else reason
    yield event({"type": "message_delta",
                 "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage(last_usage)})
    yield event({"type": "message_stop"})


# ---------------------------------------------------------------------- routes


class AnthropicMessages:
    """The Messages API over an ``OpenAIServing``."""

    def __init__(self, serving: Any):
        self.serving = serving

    async def create(self, body: dict[str, Any]) -> dict[str, Any] | AsyncIterator[str]:
        check_cache_control(body, self.serving.info.prefix_caching)
        req: MessagesRequest = parse(MessagesRequest, body)
        if req.thinking is not None and req.thinking.type == "enabled" and \
                not self.serving.parsing.reasoning_parser:
            raise bad_request("thinking: this server splits no thinking off the answer (it "
                              "runs without --reasoning-parser), so no thinking block would "
                              "come back", param="thinking")
        result = await self._chat_path(req, self.serving.chat, req.chat_body())
        return message_body(result) if isinstance(result, dict) else message_events(result)

    async def count_tokens(self, body: dict[str, Any]) -> dict[str, Any]:
        check_cache_control(body, self.serving.info.prefix_caching)
        req: CountTokensRequest = parse(CountTokensRequest, body)
        tokens = await self._chat_path(req, self.serving.tokenize, req.template_fields())
        return {"input_tokens": tokens["count"]}

    async def _chat_path(self, req: CountTokensRequest, call: Callable[[dict], Awaitable[Any]],
                         chat_body: dict[str, Any]) -> Any:
        """``call`` (the chat path) on the body; its refusals of fields this layer made
        (``tool_choice``, ``chat_template_kwargs``) told in the request's terms."""
        self._check_thinking_history(req, chat_body["messages"])
        try:
            return await call(chat_body)
        except ApiError as exc:
            raise _in_anthropic_terms(req, chat_body, exc) from None

    def _check_thinking_history(self, req: CountTokensRequest,
                                messages: list[dict[str, Any]]) -> None:
        """Thinking blocks render as reasoning: a template that never reads it would drop
        them, so they are refused there."""
        if not any(m.get("reasoning_content") for m in messages):
            return
        template = getattr(self.serving.tokenizer, "chat_template", None)
        sources = template.values() if isinstance(template, dict) else [template or ""]
        if not any("reasoning_content" in str(src) for src in sources):
            where = next(f"messages.{i}.content.{j}" for i, m in enumerate(req.messages)
                         if isinstance(m.content, list) for j, b in enumerate(m.content)
                         if isinstance(b, dict) and b.get("type") == "thinking")
            raise bad_request(f"{where}: this model's chat template does not render "
                              f"reasoning, so a thinking block would be dropped",
                              param="messages")


def _in_anthropic_terms(req: CountTokensRequest, chat_body: dict[str, Any],
                        exc: ApiError) -> ApiError:
    if exc.param == "chat_template_kwargs" and req.thinking is not None:
        return ApiError(exc.status, f"thinking: sent to the template as enable_thinking, "
                        f"and {exc.message}", param="thinking")
    if exc.param == "tool_choice":
        what = (f"type {req.tool_choice.type!r} is the chat path's "
                f"{json.dumps(chat_body.get('tool_choice'))}" if req.tool_choice else
                "unset, which is 'auto' with tools")
        return ApiError(exc.status, f"tool_choice: {what}: {exc.message}", param="tool_choice")
    if exc.param == "tools":  # a tool's schema, as a forced tool_choice reads it
        return ApiError(exc.status, exc.message.replace(".function.parameters", ".input_schema"),
                        param="tools")
    return exc


def add_anthropic_routes(app: FastAPI, serving: Any, gate: Gate,
                         respond: Callable[[Any], Response]) -> None:
    """The routes, and the error reshaping around the whole app (call after the gate's
    middleware is added, so this one is outside it)."""
    messages = AnthropicMessages(serving)
    app.add_middleware(AnthropicErrors)

    @app.post(PREFIX)
    async def create_message(request: Request) -> Response:
        return respond(await messages.create(await gate.json(request)))

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return JSONResponse(await messages.count_tokens(await gate.json(request)))


class AnthropicErrors:
    """Pure ASGI, outermost: under /v1/messages an error answer (status >= 400, OpenAI's
    JSON from whichever handler) is re-sent in Anthropic's shape, and an unexpected
    exception before the answer started becomes Anthropic's 500; anything else passes
    untouched."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_messages_path(app_path(scope)):
            return await self.app(scope, receive, send)
        held: dict[str, Any] = {}  # an error answer's start, and its body so far
        started = False

        async def reshape(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    held.update(start=message, body=b"")
                    return
            elif "start" in held and message["type"] == "http.response.body":
                held["body"] += message.get("body", b"")
                if not message.get("more_body"):
                    await _send_reshaped(held["start"], held["body"], send)
                return
            await send(message)

        try:
            await self.app(scope, receive, reshape)
        except Exception:
            if started:
                raise
            log.exception("unexpected error in a request")
            await _send_reshaped({"type": "http.response.start", "status": 500},
                                 b'{"error": {"message": "internal server error"}}', send)


async def _send_reshaped(start: dict[str, Any], body: bytes, send: Any) -> None:
    status = start["status"]
    try:
        err = json.loads(body)["error"]
        message = _message(err if isinstance(err, dict) else {"message": str(err)})
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip() or f"HTTP {status}"
    data = json.dumps(error_body(error_type(status), message), ensure_ascii=False).encode()
    headers = [(k, v) for k, v in start.get("headers", [])
               if k.lower() not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode())]
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": data})
