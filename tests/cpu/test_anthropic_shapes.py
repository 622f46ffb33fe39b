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
from epserve.deploy.anthropic_blocks import to_anthropic_id, to_chat_id
from epserve.deploy.anthropic_models import MessagesRequest, parse
from epserve.deploy.chat_output import ChatParsing, ToolPlan, choice_parser
from epserve.deploy.errors import ApiError
from epserve.deploy.openai_models import ChatCompletionRequest, validate
from epserve.deploy.tool_parser import new_call_id

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
    open_index, partial_json = None, ""
    for e in events[1:-1]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == len(msg["content"])
            msg["content"].append(dict(e["content_block"]))
            open_index = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            block = msg["content"][open_index]
            if e["delta"]["type"] == "input_json_delta":  # a tool_use block's input, as JSON
                assert block["type"] == "tool_use" and block["input"] == {}
                partial_json += e["delta"]["partial_json"]
                continue
            kind = e["delta"]["type"].removesuffix("_delta")
            block[kind] += e["delta"][kind]
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_index
            if msg["content"][open_index]["type"] == "tool_use":
                msg["content"][open_index]["input"] = json.loads(partial_json or "{}")
            open_index, partial_json = None, ""
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


# ---------------------------------------------------------------- tools and thinking

PARSING = ChatParsing(enable_auto_tool_choice=True, tool_call_parser="hermes",
                      reasoning_parser="qwen3")
CALL_TEXT = ('<think>Weather, so a call.</think>Let me check.<tool_call>\n'
             '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _parsed(text: str, pieces: int) -> tuple[dict, list[dict]]:
    """``text`` through the chat path's real parsers: the whole message, and the stream's
    deltas for the text cut into ``pieces`` equal parts."""
    plan = ToolPlan([{}], parse=True, parallel=True)
    whole = choice_parser(PARSING, plan, False, whole=True)
    message = whole.message(text)
    message["finish_reason"] = whole.finish_reason("stop")
    stream = choice_parser(PARSING, plan, False, whole=False)
    k = -(-len(text) // pieces)
    cuts = [text[i:i + k] for i in range(0, len(text), k)]
    deltas = [stream.step(c, finished=i == len(cuts) - 1) for i, c in enumerate(cuts)]
    return message, [d for d in deltas if d]


def _ids_out(msg: dict) -> tuple[dict, list[str]]:
    ids = [b.pop("id") for b in msg["content"] if b["type"] == "tool_use"]
    return msg, ids


@pytest.mark.parametrize("pieces", [1, 3, 17, len(CALL_TEXT)])
def test_tool_calls_are_tool_use_blocks_whole_and_streamed(pieces):
    message, deltas = _parsed(CALL_TEXT, pieces)
    whole, whole_ids = _ids_out(message_body({**HEAD, "choices": [{
        "index": 0, "message": message, "finish_reason": message.pop("finish_reason"),
        "stop_reason": None}], "usage": USAGE}))
    assert whole["stop_reason"] == "tool_use" and whole["stop_sequence"] is None
    assert whole["content"] == [
        {"type": "thinking", "thinking": "Weather, so a call.", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "name": "get_time", "input": {}}]
    events = _events(_chunks(deltas, "tool_calls"))
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b.get("input") for b in starts] == [None, None, {}, {}]  # tool_use opens empty
    streamed, streamed_ids = _ids_out(_accumulate(events))
    assert streamed == whole
    for ids in (whole_ids, streamed_ids):
        assert len(set(ids)) == 2 and all(i.startswith("toolu_") for i in ids)


def test_tool_ids_map_back_to_the_chat_paths():
    chat_id = new_call_id()
    assert to_chat_id(to_anthropic_id(chat_id)) == chat_id
    assert to_chat_id("call_123") == "call_123"  # an id made elsewhere is kept


def _request(**kw) -> dict:
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    return parse(MessagesRequest, {**body, **kw}).chat_body()


WEATHER = {"name": "get_weather", "description": "The weather.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_a_tool_loop_translates_to_the_chat_history():
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "A call.", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "P"}},
            {"type": "tool_use", "id": "elsewhere", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C"},
            {"type": "tool_result", "tool_use_id": "elsewhere", "is_error": True,
             "content": [{"type": "text", "text": "no city"}, {"type": "text", "text": "!"}]},
            {"type": "text", "text": "And?"}]}]
    body = _request(messages=history, tools=[WEATHER], thinking={"type": "disabled"},
                    tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather.",
        "parameters": WEATHER["input_schema"]}}]
    assert (body["tool_choice"], body["parallel_tool_calls"]) == ("auto", False)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    chat = validate(ChatCompletionRequest, body)  # what the chat path reads
    msgs = [m.to_template() for m in chat.messages]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "user"]
    assistant = msgs[1]
    assert assistant["content"] == "Checking." and assistant["reasoning_content"] == "A call."
    assert [(c["id"], c["function"]["arguments"]) for c in assistant["tool_calls"]] == [
        (to_chat_id("toolu_1"), {"city": "P"}), ("elsewhere", {})]
    assert [(m["tool_call_id"], m["content"]) for m in msgs[2:4]] == [
        (assistant["tool_calls"][0]["id"], "22 C"), ("elsewhere", "Error: no city\n!")]
    assert msgs[4]["content"] == "And?"


@pytest.mark.parametrize("choice, chat", [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
     {"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "parallel_tool_calls": False}),
])
def test_tool_choice_is_the_chat_paths(choice, chat):
    body = _request(tools=[WEATHER], tool_choice=choice)
    assert {k: body[k] for k in chat} == chat and ("parallel_tool_calls" in body) == \
        ("parallel_tool_calls" in chat)


ASSISTANT_CALL = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}


@pytest.mark.parametrize("fields, says", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools.0.name"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "none", "disable_parallel_tool_use": True}}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "cannot be honoured"),
    ({"thinking": {"type": "adaptive"}}, "thinking.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f",
                                                 "input": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": "Hi"}, ASSISTANT_CALL,
                   {"role": "user", "content": [{"type": "tool_result",
                                                 "tool_use_id": "toolu_2"}]}]},
     "messages.2.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": "Hi"}, ASSISTANT_CALL]},
     "messages.1.content.0.type: a final assistant message is continued"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}]}, "messages.1.content.0.type"),
])
def test_what_cannot_be_served_is_a_400_naming_it(fields, says):
    with pytest.raises(ApiError) as e:
        _request(**fields)
    assert e.value.status == 400 and says in e.value.message, e.value.message


def test_arguments_that_are_no_json_object_still_make_a_message():
    # the model wrote "arguments" as a string: its text is the arguments, JSON or not
    message, _ = _parsed('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
                         '<tool_call>{"name": "g", "arguments": "not json"}</tool_call>', 1)
    body = message_body({**HEAD, "choices": [{"index": 0, "message": message,
                                             "finish_reason": "tool_calls"}], "usage": USAGE})
    assert [(b["name"], b["input"]) for b in body["content"]] == [("f", {"a": 1}),
                                                                   ("g", "not json")]


def test_cache_control_is_refused_where_no_prefix_is_cached():
    """With the prefix cache (the default) cache_control is honoured by it; without it the
    field could do nothing, so it is a 400 naming it, wherever it sits in the body."""
    from epserve.deploy.anthropic_models import check_cache_control
    from epserve.deploy.errors import ApiError

    nested = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}
    top = {"model": "m", "max_tokens": 4, "messages": [], "cache_control": {"type": "ephemeral"}}
    plain = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for body in (nested, top, plain):
        check_cache_control(body, prefix_caching=True)  # nothing refused
    check_cache_control(plain, prefix_caching=False)
    for body in (nested, top):
        with pytest.raises(ApiError) as err:
            check_cache_control(body, prefix_caching=False)
        assert err.value.status == 400 and err.value.param == "cache_control"
