"""Anthropic's Messages API (/v1/messages), as an Anthropic user calls it: the official
``anthropic`` client against the live server. A message is the chat path's answer in
Anthropic's shape (greedy text equal to the chat completion's), streamed as Anthropic's events
(both client styles), with Anthropic's stop reasons, usage and errors, the key also accepted
as ``x-api-key``; /v1/messages/count_tokens counts what the template renders."""

from __future__ import annotations

import json

import anthropic
import pytest
import requests
from serverkit import API_KEY, metric, scrape, wait_for

HI = [{"role": "user", "content": "Hi"}]
LONG = [{"role": "user", "content": "Tell me a long story about the experts of the mixture."}]
GREEDY = {"temperature": 0}  # this client has no temperature keyword: sent as extra_body
# the client drops ping events; the raw stream has one after message_start
EVENT_ORDER = ["message_start", "content_block_start", "content_block_delta",
               "content_block_stop", "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key=server.api_key, max_retries=0,
                               timeout=120)


def _create(claude, server, **kw):
    kw.setdefault("messages", HI)
    kw.setdefault("max_tokens", 8)
    return claude.messages.create(model=server.model, **kw)


def _count(claude, server, **kw) -> int:
    return claude.messages.count_tokens(model=server.model, **kw).input_tokens


def _prompt_tokens(msg) -> int:
    return msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def _post(server, body: dict, headers: dict | None = None, path: str = "/v1/messages"):
    return requests.post(f"{server.base}{path}", json=body, timeout=60,
                         headers=server.auth if headers is None else headers)


def _anthropic_error(r: requests.Response, status: int, kind: str) -> str:
    assert r.status_code == status, (r.status_code, r.text[:300])
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    return body["error"]["message"]


# ---------------------------------------------------------------- a message


def test_a_message_has_anthropics_shape(server, claude):
    msg = _create(claude, server, max_tokens=6)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == server.model
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert 1 <= msg.usage.output_tokens <= 6
    assert _prompt_tokens(msg) == _count(claude, server, messages=HI)
    raw = _post(server, {"model": server.model, "max_tokens": 2, "messages": HI})
    assert raw.status_code == 200, raw.text
    assert set(raw.json()) == {"id", "type", "role", "model", "content", "stop_reason",
                               "stop_sequence", "usage"}
    assert set(raw.json()["usage"]) == {"input_tokens", "output_tokens",
                                        "cache_creation_input_tokens",
                                        "cache_read_input_tokens"}


def test_greedy_text_is_the_chat_completions(server, claude, client):
    msg = _create(claude, server, messages=LONG, max_tokens=12, extra_body=GREEDY)
    chat = client.chat.completions.create(model=server.model, messages=LONG, max_tokens=12,
                                          temperature=0)
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert _prompt_tokens(msg) == chat.usage.prompt_tokens


def test_max_tokens_ends_with_max_tokens(server, claude):
    msg = _create(claude, server, messages=LONG, max_tokens=5, extra_body=GREEDY)
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 5


def test_a_stop_sequence_ends_the_message(server, claude):
    full = _create(claude, server, messages=LONG, max_tokens=16, extra_body=GREEDY)
    text = full.content[0].text
    k = len(text) // 2
    stop = text[k:k + 2]
    assert stop.strip() and full.stop_reason == "max_tokens", text
    msg = _create(claude, server, messages=LONG, max_tokens=16, stop_sequences=[stop],
                  extra_body=GREEDY)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]
    assert msg.usage.output_tokens < full.usage.output_tokens


def test_the_system_prompt_reaches_the_template(server, claude):
    system = "You are a terse assistant who answers in one word."
    bare = _create(claude, server, max_tokens=1)
    told = _create(claude, server, max_tokens=1, system=system)
    assert _prompt_tokens(told) > _prompt_tokens(bare)
    assert _prompt_tokens(told) == _count(claude, server, messages=HI, system=system)
    blocks = [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]
    assert _count(claude, server, messages=HI, system=blocks) == _prompt_tokens(told)


def test_a_final_assistant_message_is_continued(server, claude, client):
    convo = LONG + [{"role": "assistant", "content": "Once upon a time"}]
    msg = _create(claude, server, messages=convo, max_tokens=8, extra_body=GREEDY)
    chat = client.chat.completions.create(
        model=server.model, messages=convo, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert msg.content[0].text == chat.choices[0].message.content
    assert _prompt_tokens(msg) == chat.usage.prompt_tokens


def test_text_blocks_and_metadata(server, claude):
    blocks = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    msg = _create(claude, server, messages=blocks, metadata={"user_id": "u-1"})
    assert msg.content[0].type == "text"
    assert _count(claude, server, messages=blocks) == _count(claude, server, messages=HI)


def test_count_tokens_is_the_templates_length(server, claude):
    r = requests.post(f"{server.base}/tokenize", headers=server.auth, timeout=30,
                      json={"model": server.model, "messages": LONG})
    assert _count(claude, server, messages=LONG) == r.json()["count"]


# ---------------------------------------------------------------- streaming


def test_stream_helper_matches_the_whole_message(server, claude):
    whole = _create(claude, server, messages=LONG, max_tokens=10, extra_body=GREEDY)
    with claude.messages.stream(model=server.model, messages=LONG, max_tokens=10,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.id.startswith("msg_") and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_tokens(final) == _prompt_tokens(whole)


def test_create_stream_sends_anthropics_event_sequence(server, claude):
    events = list(_create(claude, server, messages=LONG, max_tokens=4, stream=True,
                          extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == EVENT_ORDER[:2] and kinds[-3:] == EVENT_ORDER[-3:], kinds
    assert set(kinds[2:-3]) == {"content_block_delta"}, kinds
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert events[0].message.usage.input_tokens > 0
    assert all(e.index == 0 and e.delta.type == "text_delta" for e in events[2:-3])
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 4


def test_a_streamed_stop_sequence(server, claude):
    full = _create(claude, server, messages=LONG, max_tokens=16, extra_body=GREEDY)
    text = full.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    with claude.messages.stream(model=server.model, messages=LONG, max_tokens=16,
                                stop_sequences=[stop], extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == text[:text.index(stop)]


def test_every_sse_event_has_its_event_line(server):
    body = {"model": server.model, "max_tokens": 3, "messages": HI, "stream": True}
    with requests.post(f"{server.base}/v1/messages", json=body, headers=server.auth,
                       stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.text
    names = []
    for frame in (f for f in raw.split("\n\n") if f.strip()):
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        names.append(name[len("event: "):])
        assert json.loads(data[len("data: "):])["type"] == names[-1]
    assert names[:3] == ["message_start", "ping", "content_block_start"], names
    assert names[-3:] == EVENT_ORDER[-3:], names


def test_a_client_leaving_a_stream_aborts_its_request(server, claude):
    first = _create(claude, server, messages=LONG, max_tokens=200, extra_body=GREEDY)
    assert first.stop_reason == "max_tokens"  # so only an abort can end the next one early
    aborted = metric(scrape(server), "vllm:request_success_total", finished_reason="abort")
    body = {"model": server.model, "max_tokens": 3000, "messages": LONG, "stream": True,
            "temperature": 0}
    with requests.post(f"{server.base}/v1/messages", json=body, headers=server.auth,
                       stream=True, timeout=60) as r:
        assert next(r.iter_lines()) == b"event: message_start"
    assert wait_for(lambda: metric(scrape(server), "vllm:request_success_total",
                                   finished_reason="abort") == aborted + 1, timeout_s=20)
    assert metric(scrape(server), "vllm:num_requests_running") == 0


# ---------------------------------------------------------------- errors


def _refused(call, **kw) -> anthropic.BadRequestError:
    with pytest.raises(anthropic.BadRequestError) as e:
        call(**kw)
    assert e.value.body["type"] == "error", e.value.body
    assert e.value.body["error"]["type"] == "invalid_request_error", e.value.body
    return e.value


def test_max_tokens_is_required(server):
    r = _post(server, {"model": server.model, "messages": HI})
    assert "max_tokens" in _anthropic_error(r, 400, "invalid_request_error")


@pytest.mark.parametrize("field, value", [("guided_json", {}), ("service_tier", "auto"),
                                          ("n", 2)])
def test_an_unknown_field_is_a_400_naming_it(server, claude, field, value):
    err = _refused(_create, claude=claude, server=server, extra_body={field: value})
    assert field in err.message and "does not support" in err.message, err.body


def test_a_bad_message_is_a_400_naming_it(server, claude):
    err = _refused(_create, claude=claude, server=server,
                   messages=[{"role": "system", "content": "Hi"}])
    assert "messages.0.role" in err.message, err.body
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    err = _refused(_create, claude=claude, server=server,
                   messages=[{"role": "user", "content": [image]}])
    assert "messages.0.content.0" in err.message and "not supported" in err.message
    err = _refused(_create, claude=claude, server=server, messages=[])
    assert "messages" in err.message


@pytest.mark.parametrize("field, value, says", [
    # (tools and thinking: test_anthropic_tools.py, against a server that parses them)
    ("tools", [{"name": "f", "input_schema": {"type": "object"}}], "--enable-auto-tool-choice"),
    ("tool_choice", {"type": "any"}, "tools` must be set"),
    ("thinking", {"type": "enabled", "budget_tokens": 1024}, "--reasoning-parser"),
    ("temperature", 1.5, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("stop_sequences", [""], "stop_sequences"),
    ("metadata", {"user_id": "u", "plan": "pro"}, "metadata.plan"),
])
def test_what_the_server_cannot_honour_is_refused(server, claude, field, value, says):
    err = _refused(_create, claude=claude, server=server, extra_body={field: value})
    assert says in err.message, err.body


def test_a_prompt_too_long_is_refused(server, claude):
    err = _refused(_create, claude=claude, server=server, max_tokens=10**6)
    assert "max_tokens" in err.message and "context length" in err.message, err.body


def test_an_unknown_model_is_not_found(server, claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=2, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error", e.value.body


def test_a_bad_key_is_an_authentication_error(server):
    bad = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=server.model, max_tokens=2, messages=HI)
    assert e.value.body["error"]["type"] == "authentication_error", e.value.body


def test_the_key_in_x_api_key(server):
    body = {"model": server.model, "max_tokens": 2, "messages": HI}
    ok = _post(server, body, headers={"x-api-key": API_KEY})
    assert ok.status_code == 200 and ok.json()["type"] == "message", ok.text
    _anthropic_error(_post(server, body, headers={"x-api-key": "wrong"}), 401,
                     "authentication_error")
    _anthropic_error(_post(server, body, headers={}), 401, "authentication_error")
    chat = requests.post(f"{server.v1}/chat/completions", headers={"x-api-key": API_KEY},
                         json={"model": server.model, "messages": HI, "max_tokens": 2},
                         timeout=60)
    assert chat.status_code == 200, chat.text


def test_errors_of_the_edge_have_anthropics_shape(server):
    r = requests.get(f"{server.base}/v1/messages", headers=server.auth, timeout=30)
    _anthropic_error(r, 405, "invalid_request_error")
    r = _post(server, {}, path="/v1/messages/batches")
    _anthropic_error(r, 404, "not_found_error")
    r = requests.post(f"{server.base}/v1/messages", data=b"x" * (2 << 20), timeout=30,
                      headers={**server.auth, "content-type": "application/json"})
    _anthropic_error(r, 413, "request_too_large")
    r = requests.post(f"{server.base}/v1/messages", data=b"{}", timeout=30,
                      headers={**server.auth, "content-type": "text/plain"})
    _anthropic_error(r, 415, "invalid_request_error")
    # the OpenAI routes keep OpenAI's shape
    r = requests.post(f"{server.v1}/chat/completions", json={}, headers=server.auth,
                      timeout=30)
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
