"""Tools and thinking on Anthropic's /v1/messages, with the official ``anthropic`` client against
the scripted server (conftest: ``--enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3``; scripted_model.py): after the generation prompt its model thinks and
then calls ``get_weather``; with thinking disabled it answers in text; after a prefilled
``[[two]]`` it writes text and two calls. The session's demo server (no parsers, a template
with no tools, thinking or reasoning) shows what is refused."""

from __future__ import annotations

import json

import anthropic
import pytest
import requests
from scripted_model import REASONING, WEATHER_ARGS

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [
    {"name": "get_weather", "description": "The current weather in a city.",
     "input_schema": {"type": "object", "properties": {
         "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius"]}},
         "required": ["city"]}},
    {"name": "get_time", "description": "The time in a zone.",
     "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}},
]
TWO = ASK + [{"role": "assistant", "content": "[[two]]"}]  # prefill: text and two calls


def _client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base, api_key=srv.api_key, max_retries=0,
                               timeout=120)


@pytest.fixture(scope="module")
def claude(scripted_server) -> anthropic.Anthropic:
    return _client(scripted_server)


def _create(claude, srv, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 64)
    return claude.messages.create(model=srv.model, **kw)


def _streamed(claude, srv, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 64)
    with claude.messages.stream(model=srv.model, **kw) as stream:
        events = list(stream)
        return stream.get_final_message(), events


def _blocks(msg) -> list[tuple]:
    """A message's content with the tool ids left out (each request makes new ones)."""
    out = []
    for b in msg.content:
        if b.type == "tool_use":
            assert b.id.startswith("toolu_"), b.id
            out.append(("tool_use", b.name, b.input))
        else:
            out.append((b.type, b.thinking if b.type == "thinking" else b.text))
    return out


def _refused(call, **kw) -> str:
    with pytest.raises(anthropic.BadRequestError) as e:
        call(**kw)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


CALL = [("thinking", REASONING), ("tool_use", "get_weather", json.loads(WEATHER_ARGS))]
TWO_CALLS = [("text", "Checking both cities."), ("tool_use", "get_weather", {"city": "Paris"}),
             ("tool_use", "get_time", {"zone": "CET"})]


# ---------------------------------------------------------------- tool_use blocks


def test_a_generated_call_is_a_tool_use_block(scripted_server, claude):
    msg = _create(claude, scripted_server, tools=TOOLS)
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert _blocks(msg) == CALL  # no text block: only whitespace was beside the call
    two = _create(claude, scripted_server, tools=TOOLS, messages=TWO)
    assert _blocks(two) == TWO_CALLS and two.stop_reason == "tool_use"
    assert len({b.id for b in two.content if b.type == "tool_use"}) == 2


def test_streamed_tool_use_blocks_add_up_to_the_whole_message(scripted_server, claude):
    for messages, want in ((ASK, CALL), (TWO, TWO_CALLS)):
        final, events = _streamed(claude, scripted_server, tools=TOOLS, messages=messages)
        assert _blocks(final) == want and final.stop_reason == "tool_use"
        starts = {e.index: e.content_block for e in events if e.type == "content_block_start"}
        uses = {i: b for i, b in starts.items() if b.type == "tool_use"}
        assert [b.input for b in uses.values()] == [{}] * len(uses) == [{}] * (len(want) - 1)
        pieces = {i: [e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.index == i] for i in uses}
        assert [json.loads("".join(p)) for p in pieces.values()] == [w[2] for w in want[1:]]
        if messages is ASK:  # the model's own text (two tokens: one or two pieces, as a
            # reader behind the engine gets them; tests/cpu cuts it at every size)
            assert "".join(pieces[max(uses)]) == WEATHER_ARGS
            assert set(pieces[max(uses)]) <= {'{"city": ', '"Paris", "unit": "celsius"}',
                                              WEATHER_ARGS}


def test_disable_parallel_tool_use_keeps_the_first_call(scripted_server, claude):
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    msg = _create(claude, scripted_server, tools=TOOLS, messages=TWO, tool_choice=choice)
    assert _blocks(msg) == TWO_CALLS[:2]
    final, _ = _streamed(claude, scripted_server, tools=TOOLS, messages=TWO,
                         tool_choice=choice)
    assert _blocks(final) == TWO_CALLS[:2]


def test_tool_choice_none_renders_tools_and_parses_nothing(scripted_server, claude):
    msg = _create(claude, scripted_server, tools=TOOLS, tool_choice={"type": "none"})
    assert msg.stop_reason == "end_turn" and [b.type for b in msg.content] == ["thinking",
                                                                               "text"]
    assert msg.content[1].text.startswith("\n\n<tool_call>\n")  # the raw text
    bare = claude.messages.count_tokens(model=scripted_server.model, messages=ASK)
    told = claude.messages.count_tokens(model=scripted_server.model, messages=ASK, tools=TOOLS)
    assert told.input_tokens > bare.input_tokens + 40
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == told.input_tokens


# ---------------------------------------------------------------- the tool loop


def _chat_prompt(srv, messages: list[dict], tools: list[dict]) -> tuple[int, str]:
    """The chat path's rendering of a chat history: its length and text."""
    r = requests.post(f"{srv.base}/tokenize", headers=srv.auth, timeout=30,
                      json={"messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = requests.post(f"{srv.base}/detokenize", headers=srv.auth, timeout=30,
                         json={"tokens": ids}).json()["prompt"]
    return len(ids), text


def test_the_tool_loop_renders_the_results_into_the_prompt(scripted_server, claude):
    first = _create(claude, scripted_server, tools=TOOLS)
    use = next(b for b in first.content if b.type == "tool_use")
    history = ASK + [{"role": "assistant", "content": first.content},  # as the client has it
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use.id, "content": "22 C"}]}]
    again = _create(claude, scripted_server, tools=TOOLS, messages=history)
    # the prompt again ends in the generation prompt: the script's call, from the start
    assert _blocks(again) == CALL and again.stop_reason == "tool_use"
    # the prompt is the chat path's rendering of the same history, thinking and call included
    chat_tools = [{"type": "function", "function": {
        "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
        for t in TOOLS]
    chat_history = ASK + [
        {"role": "assistant", "content": "", "reasoning_content": REASONING, "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_weather", "arguments": WEATHER_ARGS}}]},
        {"role": "tool", "tool_call_id": "c", "content": "22 C"}]
    count, text = _chat_prompt(scripted_server, chat_history, chat_tools)
    assert '{"name": "get_weather", "arguments": ' + WEATHER_ARGS + "}" in text
    assert "<tool_response>\n22 C\n</tool_response>" in text and REASONING in text
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == count
    counted = claude.messages.count_tokens(model=scripted_server.model, messages=history,
                                           tools=TOOLS).input_tokens
    assert counted == count
    # an error result renders behind "Error: "
    history[-1]["content"][0]["is_error"] = True
    chat_history[-1]["content"] = "Error: 22 C"
    assert claude.messages.count_tokens(model=scripted_server.model, messages=history,
                                        tools=TOOLS).input_tokens == \
        _chat_prompt(scripted_server, chat_history, chat_tools)[0] > count


def test_a_tool_result_must_answer_a_tool_use(scripted_server, claude):
    history = ASK + [{"role": "assistant", "content": "Let me see."},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": "toolu_x", "content": "1"}]}]
    says = _refused(_create, claude=claude, srv=scripted_server, tools=TOOLS, messages=history)
    assert "messages.2.content.0.tool_use_id" in says, says


# ---------------------------------------------------------------- thinking


def test_thinking_enabled_and_disabled(scripted_server, claude):
    on = _create(claude, scripted_server, thinking={"type": "enabled", "budget_tokens": 64})
    assert [b.type for b in on.content] == ["thinking", "text"]
    assert on.content[0].thinking == REASONING
    off = _create(claude, scripted_server, thinking={"type": "disabled"})
    assert _blocks(off) == [("text", "It is sunny in Paris today.")]
    assert off.stop_reason == "end_turn"
    prompt = off.usage.input_tokens + off.usage.cache_read_input_tokens
    assert prompt > on.usage.input_tokens + on.usage.cache_read_input_tokens
    assert prompt == claude.messages.count_tokens(model=scripted_server.model, messages=ASK,
                                                  thinking={"type": "disabled"}).input_tokens
    final, events = _streamed(claude, scripted_server, thinking={"type": "disabled"})
    assert _blocks(final) == _blocks(off)
    assert not any(e.type == "content_block_start" and e.content_block.type == "thinking"
                   for e in events)
    final, _ = _streamed(claude, scripted_server, thinking={"type": "enabled",
                                                             "budget_tokens": 64})
    assert _blocks(final) == _blocks(on)


def test_a_thinking_budget_that_would_bind_is_refused(scripted_server, claude):
    says = _refused(_create, claude=claude, srv=scripted_server, max_tokens=64,
                    thinking={"type": "enabled", "budget_tokens": 32})
    assert says.startswith("thinking.budget_tokens") and "cannot be honoured" in says, says


def test_thinking_blocks_in_the_history_render_as_reasoning(scripted_server, claude):
    thought = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Paris is in France.", "signature": ""},
        {"type": "text", "text": "Sunny."}]}
    without = {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]}
    count = {}
    for name, turn in (("with", thought), ("without", without)):
        count[name] = claude.messages.count_tokens(
            model=scripted_server.model, messages=ASK + [turn] + ASK).input_tokens
    rendered, _ = _chat_prompt(scripted_server, ASK + [
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Paris is in France."}]
        + ASK, [])
    assert count["with"] == rendered > count["without"]


def test_what_the_demo_server_cannot_do_is_refused(server):
    demo = _client(server)
    says = _refused(_create, claude=demo, srv=server, max_tokens=8,
                    thinking={"type": "enabled", "budget_tokens": 8})
    assert says.startswith("thinking: ") and "--reasoning-parser" in says, says
    # its template has no enable_thinking switch: disabling would change nothing
    says = _refused(_create, claude=demo, srv=server, max_tokens=8,
                    thinking={"type": "disabled"})
    assert says.startswith("thinking: ") and "enable_thinking" in says, says
    history = ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "text", "text": "Sunny."}]}, {"role": "user", "content": "Sure?"}]
    says = _refused(_create, claude=demo, srv=server, max_tokens=8, messages=history)
    assert "messages.1.content.0" in says and "reasoning" in says, says
    # tools: without the server's tool flags, auto (the default) is refused; none reaches the
    # template, which cannot render them
    says = _refused(_create, claude=demo, srv=server, max_tokens=8, tools=TOOLS)
    assert says.startswith("tool_choice: unset") and "--enable-auto-tool-choice" in says, says
    says = _refused(_create, claude=demo, srv=server, max_tokens=8, tools=TOOLS,
                    tool_choice={"type": "none"})
    assert says.startswith("tools") and "does not render tools" in says, says
