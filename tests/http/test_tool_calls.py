"""Tool calls on /v1/chat/completions as a vLLM user makes them, with the openai client.

The session's demo server runs without vLLM's tool flags; the scripted server (conftest:
``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``) serves a
model whose greedy text is a script (scripted_model.py), so the engine really generates tool
calls: after the generation prompt one call (after its thinking); after a prefilled final
assistant message ``[[two]]`` content and two calls; ``[[plain]]`` text that only starts like a
tag; ``[[bad]]`` a block that is no call.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests
from scripted_model import BAD_TEXT, PLAIN_TEXT, REASONING, WEATHER_ARGS

from epserve.deploy.chat_output import AUTO_NEEDS_FLAGS

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _prefilled(trigger: str) -> dict:
    """Messages and fields that make the scripted model generate ``trigger``'s script."""
    return dict(messages=ASK + [{"role": "assistant", "content": trigger}],
                extra_body={"add_generation_prompt": False, "continue_final_message": True})


def _refused(call, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    return e.value


def _stream(client, **kw):
    """(content, reasoning, calls as a client assembles them, finish_reason, chunks)."""
    content, reasoning, calls, finish, chunks = "", "", {}, None, []
    for ch in client.chat.completions.create(stream=True, **kw):
        chunks.append(ch)
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # a call's first delta: its id, type and name
                    assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function"
                    assert tc.function.name and tc.index == len(calls)
                    calls[tc.index] = [tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None
                calls[tc.index][1] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, reasoning, [tuple(v) for _, v in sorted(calls.items())], finish, chunks


# ---------------------------------------------------------------- refusals


def test_auto_tool_choice_needs_the_servers_flags(server, client):
    for extra in ({}, {"tool_choice": "auto"}):  # tools alone default to auto, as in vLLM
        err = _refused(client.chat.completions.create, model=server.model, messages=ASK,
                       max_tokens=2, tools=TOOLS, **extra)
        assert err.param == "tool_choice" and err.body["message"] == AUTO_NEEDS_FLAGS, err.body


def test_tool_field_mistakes_are_400s_naming_them(scripted_server, scripted_client):
    create = scripted_client.chat.completions.create
    kw = dict(model=scripted_server.model, messages=ASK, max_tokens=2)
    assert _refused(create, tool_choice="auto", **kw).param == "tool_choice"  # no tools
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    assert _refused(create, tools=strict, **kw).param == "tools"
    assert _refused(create, tools=[{"type": "web_search"}], **kw).param == "tools"


def test_tools_for_a_template_that_never_renders_them_are_refused(server, client):
    # the demo model's template has no tools: they would silently never reach the model
    err = _refused(client.chat.completions.create, model=server.model, messages=ASK,
                   max_tokens=2, tools=TOOLS, tool_choice="none")
    assert err.param == "tools" and "does not render tools" in err.message, err.body


# ---------------------------------------------------------------- the prompt


def test_tools_are_rendered_into_the_prompt(scripted_server, scripted_client):
    def tokenize(**body) -> dict:
        r = requests.post(f"{scripted_server.base}/tokenize", headers=scripted_server.auth,
                          json={"messages": ASK, "return_token_strs": True, **body}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    bare, with_tools = tokenize(), tokenize(tools=TOOLS)
    assert with_tools["count"] > bare["count"] + 40
    text = "".join(with_tools["token_strs"]).replace("Ġ", " ")
    assert "get_weather" in text and "The current weather in a city." in text
    # a chat request renders them the same way: its prompt is that long
    out = scripted_client.chat.completions.create(model=scripted_server.model, messages=ASK,
                                                  tools=TOOLS, tool_choice="none", max_tokens=1)
    assert out.usage.prompt_tokens == with_tools["count"]


# ---------------------------------------------------------------- calls, whole and streamed


def test_a_generated_call_comes_back_as_tool_calls(scripted_server, scripted_client):
    out = scripted_client.chat.completions.create(model=scripted_server.model, messages=ASK,
                                                  tools=TOOLS, max_tokens=64)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content is None  # only whitespace was left beside the call
    (call,) = msg.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_weather"
    assert call.function.arguments == WEATHER_ARGS and json.loads(call.function.arguments)
    assert msg.model_extra["reasoning_content"] == REASONING  # split off first


def test_a_streamed_call_adds_up_to_the_whole_one(scripted_server, scripted_client):
    content, reasoning, calls, finish, chunks = _stream(
        scripted_client, model=scripted_server.model, messages=ASK, tools=TOOLS,
        max_tokens=64)
    assert calls == [("get_weather", WEATHER_ARGS)] and finish == "tool_calls"
    assert content == "" and reasoning == REASONING
    # no chunk carries a tag, whichever tokens arrived together
    deltas = [c.delta for ch in chunks for c in ch.choices]
    assert not any(t in (d.content or "") + ((d.model_extra or {}).get("reasoning") or "")
                   for d in deltas for t in ("<think>", "</think>", "<tool_call>", "</tool"))


def test_two_calls_content_and_parallel_tool_calls(scripted_server, scripted_client):
    kw = dict(model=scripted_server.model, tools=TOOLS, max_tokens=64, **_prefilled("[[two]]"))
    out = scripted_client.chat.completions.create(**kw)
    msg = out.choices[0].message
    assert msg.content == "Checking both cities."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in msg.tool_calls}) == 2
    content, _, calls, finish, _ = _stream(scripted_client, **kw)  # tags split over tokens
    assert content == msg.content and finish == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    one = scripted_client.chat.completions.create(parallel_tool_calls=False, **kw)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    content, _, calls, _, _ = _stream(scripted_client, parallel_tool_calls=False, **kw)
    assert [name for name, _ in calls] == ["get_weather"] and content == msg.content


def test_tool_choice_none_renders_tools_but_parses_nothing(scripted_server, scripted_client):
    out = scripted_client.chat.completions.create(model=scripted_server.model, messages=ASK,
                                                  tools=TOOLS, tool_choice="none",
                                                  max_tokens=64)
    choice = out.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert choice.message.content.startswith("\n\n<tool_call>\n")  # the raw text, as vLLM


@pytest.mark.parametrize("trigger, text", [("[[plain]]", PLAIN_TEXT), ("[[bad]]", BAD_TEXT)])
def test_text_that_is_no_call_is_content(scripted_server, scripted_client, trigger, text):
    kw = dict(model=scripted_server.model, tools=TOOLS, max_tokens=64, **_prefilled(trigger))
    out = scripted_client.chat.completions.create(**kw)
    assert out.choices[0].message.content == text and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"
    content, _, calls, finish, _ = _stream(scripted_client, **kw)
    assert content == text and calls == [] and finish == "stop"


# ---------------------------------------------------------------- the history


def test_a_reply_with_calls_and_the_tool_results_go_back_in(scripted_server, scripted_client):
    """OpenAI's tool loop: append the reply object as the client has it, then the results."""
    kw = dict(model=scripted_server.model, tools=TOOLS, max_tokens=64)
    first = scripted_client.chat.completions.create(messages=ASK, **kw).choices[0].message
    (call,) = first.tool_calls
    history = ASK + [first, {"role": "tool", "tool_call_id": call.id, "content": "22 C"}]
    r = requests.post(f"{scripted_server.base}/tokenize", headers=scripted_server.auth,
                      json={"messages": [m if isinstance(m, dict) else m.model_dump()
                                         for m in history], "tools": TOOLS,
                            "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = requests.post(f"{scripted_server.base}/detokenize", headers=scripted_server.auth,
                         json={"tokens": ids}, timeout=30).json()["prompt"]
    # the arguments reached the template as a JSON value (not a string encoded twice)
    assert '{"name": "get_weather", "arguments": ' + WEATHER_ARGS + "}" in text
    assert "<tool_response>\n22 C\n</tool_response>" in text
    again = scripted_client.chat.completions.create(messages=history, **kw)
    assert again.choices[0].finish_reason == "tool_calls"  # the script, from the same ending


def test_bad_history_is_a_400_naming_it(scripted_server, scripted_client, server, client):
    bad_args = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    err = _refused(scripted_client.chat.completions.create, model=scripted_server.model,
                   messages=bad_args, max_tokens=2)
    assert err.param == "messages" and "tool_calls.0.function.arguments" in err.message
    good = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    # the demo template drops earlier tool calls: refused, not silently lost
    err = _refused(client.chat.completions.create, model=server.model, messages=good,
                   max_tokens=2)
    assert err.param == "messages" and "tool_calls" in err.message, err.body
