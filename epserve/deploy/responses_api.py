"""OpenAI's Responses API over the chat path: POST /v1/responses, whole or streamed.

Invariants: a request is parsed and checked here (``responses_models``), then served by
``OpenAIServing.chat`` as the chat body it translates to — the template, the tool and reasoning
parsers, the checks, the engine and the metrics are the chat path's — and its answer is
reshaped. A body becomes a ``response`` whose output items are, in order, the reasoning (a
``reasoning`` item, when a ``--reasoning-parser`` split some off), the text (a ``message``
item with one ``output_text`` part; there whenever there is text or no call) and each call (a
``function_call`` item); ``status`` is ``incomplete`` with reason ``max_output_tokens`` when
the length limit ended it. A stream becomes Responses events with consecutive
``sequence_number``s: ``response.created``, ``response.in_progress``, per item
``response.output_item.added``, its part's added / deltas / done (text, reasoning text, or
call arguments), ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete``) carrying the same response a whole request gets; an error after the
200 is one ``error`` event that ends the stream. Closing the reshaped stream closes the chat
stream (its engine request is aborted). Responses are not stored: GET and DELETE
/v1/responses/{id} are a 404 that says so. A chat error naming a chat field names the
Responses field it came from.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from epserve.deploy.errors import ApiError
from epserve.deploy.gate import Gate
from epserve.deploy.stream import chat_chunks
from epserve.deploy.responses_models import ResponsesRequest, parse

PREFIX = "/v1/responses"
#: The chat body's field -> the Responses field it came from.
_RESPONSES_NAME = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                   "max_tokens": "max_output_tokens", "chat_template_kwargs": "reasoning",
                   "response_format": "text"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _renamed(exc: ApiError) -> ApiError:
    """A chat error with the Responses field names."""
    param = _RESPONSES_NAME.get(exc.param, exc.param) if exc.param else None
    message = exc.message.replace("response_format", "text.format").replace(
        ".function.parameters", ".parameters")  # the tools are flat here
    if exc.param == "chat_template_kwargs":
        message = message.replace("chat_template_kwargs.reasoning_effort",
                                  "reasoning.effort (the template's reasoning_effort)")
    return ApiError(exc.status, message, param=param, code=exc.code, type=exc.type)


def usage(chat_usage: dict[str, Any] | None, reasoning_tokens: int) -> dict[str, Any]:
    u = chat_usage or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}


# ---------------------------------------------------------------------- items


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_part(text)] if status != "in_progress" else []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content,
            "status": status}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class Shell:
    """What every form of one response repeats: id, time, model and the request's echo."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.id, self.created_at, self.model = _id("resp"), int(time.time()), model
        tools = [t.echo() for t in req.function_tools()]
        choice = req.tool_choice or ("auto" if tools else "none")
        if isinstance(choice, dict):
            choice = {"type": "function", "name": choice.get("name")}
        self.echo = {
            "instructions": req.instructions, "metadata": req.metadata or {},
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "store": False, "background": False,
            "reasoning": req.reasoning.model_dump() if req.reasoning else None,
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": req.user}

    def body(self, status: str, output: list[dict[str, Any]],
             usage_: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output, "error": None,
                "incomplete_details": incomplete, **self.echo, "usage": usage_}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _reasoning(message: dict[str, Any]) -> str:
    return message.get("reasoning_content") or ""


def response_body(shell: Shell, chat: dict[str, Any],
                  count: Callable[[str], int]) -> dict[str, Any]:
    """A chat completion (n = 1) as the response."""
    choice = chat["choices"][0]
    msg, status = choice["message"], _status(choice["finish_reason"])
    thought, text, calls = _reasoning(msg), msg.get("content") or "", msg.get("tool_calls") or []
    output = [reasoning_item(_id("rs"), thought, "completed")] if thought else []
    if text or not calls:  # the calls after it: the text was whole
        output.append(message_item(_id("msg"), text, "completed" if calls else status))
    output += [call_item(_id("fc"), c["id"], c["function"]["name"],
                         c["function"]["arguments"], "completed") for c in calls]
    return shell.body(status, output, usage(chat["usage"], count(thought)))


# ---------------------------------------------------------------------- stream


class _Events:
    """A response's stream events: the sequence numbers, and the one open output item."""

    def __init__(self, shell: Shell):
        self.shell, self.seq, self.output = shell, 0, []
        self.kind: str | None = None  # the open item: "reasoning", "message" or "call"
        self.item: dict[str, Any] = {}
        self.text = ""

    def event(self, type_: str, **fields: Any) -> str:
        obj = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return f"event: {type_}\ndata: {data}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def open(self, kind: str, item: dict[str, Any]) -> list[str]:
        out = self.close("completed")
        self.kind, self.item, self.text = kind, item, ""
        out.append(self.event("response.output_item.added", item=item,
                              output_index=len(self.output)))
        if kind != "call":
            part = _part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
            out.append(self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=part))
        return out

    def delta(self, kind: str, text: str, new_item: Callable[[], dict[str, Any]]) -> list[str]:
        out = self.open(kind, new_item()) if kind != self.kind else []
        if not text:
            return out
        self.text += text
        name = {"message": "response.output_text.delta",
                "reasoning": "response.reasoning_text.delta",
                "call": "response.function_call_arguments.delta"}[kind]
        extra = {"content_index": 0} if kind != "call" else {}
        if kind == "message":
            extra["logprobs"] = []
        return out + [self.event(name, **self._where(), **extra, delta=text)]

    def close(self, status: str) -> list[str]:
        kind, where, text = self.kind, self._where() if self.kind else {}, self.text
        if kind is None:
            return []
        out = []
        if kind == "call":
            out.append(self.event("response.function_call_arguments.done", **where,
                                  arguments=text))
            item = {**self.item, "arguments": text, "status": "completed"}
        else:
            if kind == "message":
                out.append(self.event("response.output_text.done", **where, content_index=0,
                                      text=text, logprobs=[]))
                part, item = _part(text), message_item(self.item["id"], text, status)
            else:
                out.append(self.event("response.reasoning_text.done", **where,
                                      content_index=0, text=text))
                item = reasoning_item(self.item["id"], text, "completed")
                part = item["content"][0]
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))
        out.append(self.event("response.output_item.done", item=item,
                              output_index=len(self.output)))
        self.output.append(item)
        self.kind = None
        return out


async def response_events(shell: Shell, chunks: AsyncIterator[str],
                          count: Callable[[str], int]) -> AsyncIterator[str]:
    """The chat stream (``data:`` chunks with usage in each, then ``[DONE]``) as Responses
    events: the same output items as ``response_body`` of the whole answer."""
    ev, last_usage, finish, thought = _Events(shell), None, None, ""
    started = with_calls = False
    async with contextlib.aclosing(chat_chunks(chunks)) as read:
        async for chunk in read:
            if "error" in chunk:
                err = _renamed(ApiError(400, **{k: chunk["error"].get(k) for k in (
                    "message", "param", "code", "type")}))
                yield ev.event("error", code=err.code or err.type, message=err.message,
                               param=err.param)
                return
            last_usage = chunk.get("usage") or last_usage
            if not started:  # the opening chunk
                started = True
                yield ev.event("response.created",
                               response=shell.body("in_progress", [], None))
                yield ev.event("response.in_progress",
                               response=shell.body("in_progress", [], None))
            for choice in chunk["choices"]:
                d = choice["delta"]
                out = ev.delta("reasoning", _reasoning(d),
                               lambda: reasoning_item(_id("rs"), "", "in_progress")) \
                    if _reasoning(d) else []
                thought += _reasoning(d)
                if d.get("content"):
                    out += ev.delta("message", d["content"],
                                    lambda: message_item(_id("msg"), "", "in_progress"))
                for call in d.get("tool_calls") or []:
                    fn, with_calls = call["function"], True
                    if call.get("id"):  # a new call: its id and name come first
                        out += ev.open("call", call_item(_id("fc"), call["id"], fn["name"],
                                                         "", "in_progress"))
                    out += ev.delta("call", fn.get("arguments") or "", dict)
                for e in out:
                    yield e
                finish = choice.get("finish_reason") or finish
    status = _status(finish)
    for e in ev.close(status):
        yield e
    if not any(i["type"] == "message" for i in ev.output) and not with_calls:
        for e in ev.delta("message", "", lambda: message_item(_id("msg"), "", "in_progress")) \
                + ev.close(status):
            yield e
    final = shell.body(status, ev.output, usage(last_usage, count(thought)))
    yield ev.event(f"response.{status}", response=final)


# ---------------------------------------------------------------------- routes


class Responses:
    """The Responses API over an ``OpenAIServing``."""

    def __init__(self, serving: Any):
        self.serving = serving

    def count(self, text: str) -> int:
        """The token count of a reasoning text (re-encoded; its tags not included)."""
        tok = self.serving.tokenizer
        return len(tok.encode(text, add_special_tokens=False)) if text and tok else 0

    async def create(self, body: dict[str, Any]) -> dict[str, Any] | AsyncIterator[str]:
        req = parse(body, self.serving.parsing.reasoning_parser)
        chat_body = req.chat_body()
        try:
            result = await self.serving.chat(chat_body)
        except ApiError as exc:
            raise _renamed(exc) from None
        shell = Shell(req, self.serving.info.name)
        if isinstance(result, dict):
            return response_body(shell, result, self.count)
        return response_events(shell, result, self.count)


def add_responses_routes(app: FastAPI, serving: Any, gate: Gate,
                         respond: Callable[[Any], Response]) -> None:
    responses = Responses(serving)

    @app.post(PREFIX)
    async def create_response(request: Request) -> Response:
        return respond(await responses.create(await gate.json(request)))

    @app.get(PREFIX + "/{response_id}")
    @app.delete(PREFIX + "/{response_id}")
    async def stored_response(response_id: str) -> Response:
        raise ApiError(404, f"No response with id {response_id!r}: this server does not "
                       f"store responses", param="response_id", code="not_found")
