"""The Messages API's answer built from the chat path's (``deploy/anthropic_api.py``): a
streamed message's events add up to the same content blocks, stop reason and usage as the
whole message built from the same text — reasoning (split off by a ``--reasoning-parser``) as
a thinking block before the text — and an error after the 200 ends the stream as one
``error`` event. Every error answer under /v1/messages, whatever handler sent it in OpenAI's
shape, goes out in Anthropic's, with the type Anthropic gives its status and the field by
Anthropic's name; an unexpected exception is Anthropic's 500."""

from __future__ import annotations

import asyncio
import json

import pytest

from epserve.deploy import responses as R
from epserve.deploy.anthropic_api import AnthropicErrors, message_body, message_events

HEAD = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 0, "model": "m"}
USAGE = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
         "prompt_tokens_details": {"cached_tokens": 3}}


def _chunks(deltas: list[dict], finish: str, stop_reason=None) -> list[str]:
    """The chat path's stream of these deltas: an opening chunk, one chunk per delta (the
    last one finishing), the usage chunk, [DONE]."""
    def chunk(delta, finish_reason=None, usage=None):
        choice = R.chat_delta(0, delta, None, finish_reason,
                              stop_reason if finish_reason else None)
        return R.sse({**HEAD, "choices": [choice], "usage": usage})
    opening = chunk({"role": "assistant", "content": ""},
                    usage={**USAGE, "completion_tokens": 0, "total_tokens": 9,
                           "prompt_tokens_details": {"cached_tokens": 0}})
    body = [chunk(d, finish if k == len(deltas) - 1 else None, USAGE)
            for k, d in enumerate(deltas)]
    return [opening, *body, R.sse({**HEAD, "choices": [], "usage": USAGE}), R.sse("[DONE]")]


def _whole(deltas: list[dict], finish: str, stop_reason=None) -> dict:
    message = {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas),
               "reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas)}
    return message_body({**HEAD, "choices": [{"index": 0, "message": message,
                                             "finish_reason": finish,
                                             "stop_reason": stop_reason}],
                         "usage": USAGE})


async def _aiter(items):
    for x in items:
        yield x


def _events(chunks: list[str]) -> list[dict]:
    async def run():
        return [e async for e in message_events(_aiter(chunks))]
    out = []
    for raw in asyncio.run(run()):
        name, data = raw.rstrip("\n").split("\n")
        obj = json.loads(data.removeprefix("data: "))
        assert name == f"event: {obj['type']}"
        out.append(obj)
    return out


def _accumulate(events: list[dict]) -> dict:
    """What a client builds from the events (as the anthropic client's accumulator does)."""
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    msg = dict(events[0]["message"], content=[])
    open_index = None
    for e in events[1:-1]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(msg["content"])
            msg["content"].append(dict(e["content_block"]))
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            kind = e["delta"]["type"].removesuffix("_delta")
            msg["content"][open_index][kind] += e["delta"][kind]
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            open_index = None
        elif e["type"] == "message_delta":
            assert open_index is None
            msg.update(e["delta"], usage={**msg["usage"], **e["usage"]})
        else:
            assert e["type"] == "ping"
    return msg


@pytest.mark.parametrize("deltas, finish, stop_reason, want", [
    ([{"content": "Hel"}, {"content": "lo"}], "length", None, ("max_tokens", None)),
    ([{"content": "Hi"}], "stop", "xy", ("stop_sequence", "xy")),
    ([{"content": "Hi"}], "stop", None, ("end_turn", None)),
    ([{"content": ""}], "stop", None, ("end_turn", None)),
    ([{"reasoning_content": "thin"}, {"reasoning_content": "king"}, {"content": "ans"},
      {"content": "wer"}], "stop", 7, ("end_turn", None)),
    ([{"reasoning_content": "only thought"}], "length", None, ("max_tokens", None)),
])
def test_the_stream_adds_up_to_the_whole_message(deltas, finish, stop_reason, want):
    whole = _whole(deltas, finish, stop_reason)
    assert (whole["stop_reason"], whole["stop_sequence"]) == want
    streamed = _accumulate(_events(_chunks(deltas, finish, stop_reason)))
    assert streamed == whole
    kinds = [b["type"] for b in whole["content"]]
    thought = any(d.get("reasoning_content") for d in deltas)
    text = any(d.get("content") for d in deltas)
    assert kinds == ["thinking"] * thought + ["text"] * (text or not thought)
    assert whole["id"] == "msg_abc" and whole["type"] == "message"
    assert whole["usage"] == {"input_tokens": 6, "output_tokens": 4,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 3}


def test_an_error_after_the_start_ends_the_stream_as_an_error_event():
    chunks = _chunks([{"content": "Hi"}], "stop")[:2]
    chunks.append(R.sse({"error": {"message": "engine died", "type": "service_unavailable",
                                   "param": None, "code": None}}))
    events = _events(chunks + [R.sse("[DONE]")])
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start",
                                           "content_block_delta", "error"]
    assert events[-1]["error"] == {"type": "overloaded_error", "message": "engine died"}


def _call(app, path: str) -> tuple[int, dict, bytes]:
    """One HTTP request through the ASGI ``app``: status, headers, body."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": []}
    asyncio.run(app(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body


def _answer(status: int, body: bytes, chunked: bool = False):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        parts = [body[:5], body[5:]] if chunked else [body]
        for k, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part,
                        "more_body": k < len(parts) - 1})
    return app


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"),
                                          (401, "authentication_error"),
                                          (404, "not_found_error"), (405, "invalid_request_error"),
                                          (413, "request_too_large"), (500, "api_error"),
                                          (503, "overloaded_error")])
def test_errors_under_v1_messages_are_reshaped(status, kind):
    openai_error = json.dumps({"error": {"message": "holds 300 strings", "type": "x",
                                         "param": "stop", "code": None}}).encode()
    got, headers, body = _call(AnthropicErrors(_answer(status, openai_error, chunked=True)),
                               "/v1/messages")
    assert got == status and headers[b"www-authenticate"] == b"Bearer"
    assert int(headers[b"content-length"]) == len(body)
    assert json.loads(body) == {"type": "error", "error": {
        "type": kind, "message": "stop_sequences: holds 300 strings"}}


def test_successes_and_other_paths_pass_untouched():
    ok = b'{"type": "message"}'
    assert _call(AnthropicErrors(_answer(200, ok)), "/v1/messages")[2] == ok
    err = b'{"error": {"message": "m"}}'
    assert _call(AnthropicErrors(_answer(400, err)), "/v1/chat/completions")[2] == err
    assert _call(AnthropicErrors(_answer(400, err)), "/v1/messagesx")[2] == err


def test_an_unexpected_exception_is_anthropics_500():
    async def broken(scope, receive, send):
        raise RuntimeError("internal detail")

    status, _, body = _call(AnthropicErrors(broken), "/v1/messages/count_tokens")
    assert status == 500
    assert json.loads(body) == {"type": "error", "error": {"type": "api_error",
                                                          "message": "internal server error"}}
