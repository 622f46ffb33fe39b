"""/v1/responses (OpenAI's Responses API) with the official openai client.

The session's demo server (random weights, no parsers) gives shapes and counts; the scripted
server (conftest: ``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser
qwen3``, scripted_model.py) really generates reasoning and a tool call after the generation
prompt, so reasoning items, function_call items and the tool loop are end to end.
"""

from __future__ import annotations

import json

import openai
import pytest
import requests
from scripted_model import REASONING, WEATHER_ARGS

ASK = "What is the weather in Paris?"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather.",
          "parameters": {"type": "object", "properties": {
              "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                 if k != "type"}}]


def _refused(call, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    return e.value


def _events(client, **kw) -> list:
    return list(client.responses.create(stream=True, **kw))


def _check_sequence(events) -> None:
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def _streamed_text(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


# ---------------------------------------------------------------- whole responses


def test_string_input(server, client):
    r = client.responses.create(model=server.model, input="Hello there", max_output_tokens=5,
                                temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == server.model
    assert r.created_at > 0 and r.store is False and r.error is None
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    (part,) = msg.content
    assert part.type == "output_text" and part.annotations == []
    assert r.output_text == part.text
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 5
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens <= u.input_tokens


def test_max_output_tokens_makes_it_incomplete(server, client):
    r = client.responses.create(model=server.model, input="Count to a thousand",
                                max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.max_output_tokens == 2
    assert r.output[0].status == "incomplete"


def test_message_items_and_instructions(server, client):
    items = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "How"},
                          {"type": "input_text", "text": "are you?"}]}]
    kw = dict(model=server.model, input=items, max_output_tokens=3, temperature=0)
    bare = client.responses.create(**kw)
    told = client.responses.create(instructions="Answer in French, briefly.", **kw)
    assert told.instructions == "Answer in French, briefly." and bare.instructions is None
    assert told.usage.input_tokens > bare.usage.input_tokens
    # the items reach the template as the chat messages they are
    chat = client.chat.completions.create(
        model=server.model, max_tokens=3, temperature=0,
        messages=[{"role": "system", "content": "Answer in French, briefly."},
                  *items[:2], {"role": "user", "content": "How\nare you?"}])
    assert told.usage.input_tokens == chat.usage.prompt_tokens
    assert told.output_text == chat.choices[0].message.content
    dev = client.responses.create(instructions=None, **{
        **kw, "input": [{"role": "developer", "content": "Answer in French, briefly."},
                        *items]})
    assert dev.usage.input_tokens == told.usage.input_tokens  # developer is system


def test_metadata_user_and_sampling_fields_are_echoed(server, client):
    r = client.responses.create(model=server.model, input="Hi", max_output_tokens=2,
                                temperature=0.5, top_p=0.9, metadata={"k": "v"}, user="u1",
                                store=False)
    assert (r.metadata, r.user, r.temperature, r.top_p) == ({"k": "v"}, "u1", 0.5, 0.9)
    assert r.tools == [] and r.tool_choice == "none" and r.parallel_tool_calls is True


# ---------------------------------------------------------------- streaming


def test_stream_adds_up_to_the_whole_response(server, client):
    kw = dict(model=server.model, input="Tell me a story", max_output_tokens=12,
              temperature=0)
    whole = client.responses.create(**kw)
    events = _events(client, **kw)
    _check_sequence(events)
    types = [e.type for e in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = _streamed_text(events)
    assert text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    final = events[-1].response
    assert final.status == whole.status and final.output_text == text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_stream_helper_gets_the_final_response(scripted_server, scripted_client):
    kw = dict(model=scripted_server.model, input=ASK, max_output_tokens=64)
    with scripted_client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    whole = scripted_client.responses.create(**kw)
    assert final.status == whole.status == "completed"
    assert "".join(deltas) == final.output_text == whole.output_text
    assert [i.type for i in final.output] == [i.type for i in whole.output]


# ---------------------------------------------------------------- reasoning


def test_reasoning_items(scripted_server, scripted_client):
    r = scripted_client.responses.create(model=scripted_server.model, input=ASK,
                                         max_output_tokens=64)
    assert r.status == "completed"
    reasoning, msg = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == [REASONING] and reasoning.summary == []
    assert msg.type == "message" and msg.content[0].text.startswith("\n\n<tool_call>")
    assert "think>" not in r.output_text  # no tools asked: the call text is content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def test_streamed_reasoning_events(scripted_server, scripted_client):
    events = _events(scripted_client, model=scripted_server.model, input=ASK,
                     max_output_tokens=64)
    _check_sequence(events)
    types = [e.type for e in events]
    first_text = types.index("response.output_text.delta")
    assert types.index("response.reasoning_text.done") < first_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == REASONING
    assert all(e.output_index == 0 for e in events if e.type.startswith("response.reasoning"))
    final = events[-1]
    assert final.type == "response.completed"
    assert [i.type for i in final.response.output] == ["reasoning", "message"]
    assert final.response.output[0].content[0].text == REASONING


def test_reasoning_effort_needs_a_template_that_reads_it(server, client, scripted_server,
                                                        scripted_client):
    err = _refused(client.responses.create, model=server.model, input="Hi",
                   max_output_tokens=2, reasoning={"effort": "low"})
    assert err.param == "reasoning" and "reasoning parser" in err.message
    err = _refused(scripted_client.responses.create, model=scripted_server.model, input="Hi",
                   max_output_tokens=2, reasoning={"effort": "low"})
    assert err.param == "reasoning" and "does not use it" in err.message, err.body
    err = _refused(scripted_client.responses.create, model=scripted_server.model, input="Hi",
                   max_output_tokens=2, reasoning={"summary": "auto"})
    assert err.param == "reasoning"


# ---------------------------------------------------------------- tools


def test_function_call_items(scripted_server, scripted_client):
    r = scripted_client.responses.create(model=scripted_server.model, input=ASK,
                                         tools=TOOLS, max_output_tokens=64)
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
    call = r.output[1]
    assert call.name == "get_weather" and call.arguments == WEATHER_ARGS
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    assert r.output_text == "" and r.tool_choice == "auto"
    assert r.tools[0].name == "get_weather" and r.tools[0].parameters == TOOLS[0]["parameters"]


def test_streamed_function_call(scripted_server, scripted_client):
    kw = dict(model=scripted_server.model, input=ASK, tools=TOOLS, max_output_tokens=64)
    events = _events(scripted_client, **kw)
    _check_sequence(events)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["reasoning", "function_call"]
    assert added[1].name == "get_weather" and added[1].arguments == ""
    args = "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == WEATHER_ARGS and done.output_index == 1
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert final.output[1].arguments == WEATHER_ARGS
    assert final.output[1].call_id == added[1].call_id


def test_the_tool_loop(scripted_server, scripted_client):
    """Send the output items back with the function's result, as OpenAI's guide does."""
    kw = dict(model=scripted_server.model, tools=TOOLS, max_output_tokens=64)
    first = scripted_client.responses.create(input=ASK, **kw)
    call = first.output[1]
    history = [{"role": "user", "content": ASK}, *first.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}]
    again = scripted_client.responses.create(input=history, **kw)
    # the same prompt as the chat conversation it stands for: the turn (its reasoning and
    # call) as one assistant message, then the tool's answer
    r = requests.post(f"{scripted_server.base}/tokenize", headers=scripted_server.auth,
                      json={"tools": CHAT_TOOLS, "messages": [
                          {"role": "user", "content": ASK},
                          {"role": "assistant", "content": None,
                           "reasoning_content": REASONING, "tool_calls": [
                               {"id": call.call_id, "type": "function", "function": {
                                   "name": "get_weather", "arguments": WEATHER_ARGS}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": "22 C"}]},
                      timeout=30)
    assert r.status_code == 200, r.text
    assert again.usage.input_tokens == r.json()["count"] > first.usage.input_tokens
    assert again.output[-1].type == "function_call"  # the script, from the same ending


def test_tool_refusals(server, client, scripted_server, scripted_client):
    # without the server's tool flags, as the chat path (vLLM's 400)
    err = _refused(client.responses.create, model=server.model, input=ASK, tools=TOOLS,
                   max_output_tokens=2)
    assert err.param == "tool_choice", err.body
    create = scripted_client.responses.create
    kw = dict(model=scripted_server.model, input=ASK, max_output_tokens=2)
    err = _refused(create, tools=[{"type": "web_search"}], **kw)
    assert err.param == "tools" and "tools.0.type" in err.message


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("extra, param, says", [
    ({"frobnicate": 1}, "frobnicate", "does not support this field"),
    ({"previous_response_id": "resp_123"}, "previous_response_id", "does not store"),
    ({"store": True}, "store", "does not store"),
    ({"background": True}, "background", "storage"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}}, "text",
     "text.format.schema is an invalid JSON schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema is required"),
    ({"text": {"format": {"type": "yaml"}}}, "text", "text.format.type"),
    ({"truncation": "auto"}, "truncation", "truncation"),
])
def test_refused_fields_name_themselves(server, client, extra, param, says):
    err = _refused(client.responses.create, model=server.model, input="Hi",
                   max_output_tokens=2, extra_body=extra)
    assert err.param == param and says in err.message, err.body


@pytest.mark.parametrize("item, where", [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
     "input.0.content.0.type"),
    ({"type": "web_search_call", "id": "x"}, "input.0.type"),
    ({"type": "item_reference", "id": "msg_1"}, "input.0.type"),
    ({"role": "user", "content": "Hi", "colour": "red"}, "input.0.colour"),
    ({"role": "robot", "content": "Hi"}, "input.0.role"),
    ({"type": "function_call_output", "output": "22 C"}, "input.0.call_id"),
])
def test_bad_input_items_are_400s_naming_them(server, client, item, where):
    err = _refused(client.responses.create, model=server.model, input=[item],
                   max_output_tokens=2)
    assert err.param == "input" and err.body["message"].startswith(where), err.body


def test_chat_errors_name_the_responses_fields(server, client):
    err = _refused(client.responses.create, model=server.model, input="Hi",
                   max_output_tokens=10**9)
    assert err.param == "max_output_tokens", err.body
    err = _refused(client.responses.create, model=server.model, input=[])
    assert err.param == "input"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi", max_output_tokens=2)


def test_responses_are_not_stored(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_123")
    assert "does not store" in e.value.message
    r = requests.post(f"{server.v1}/responses", json={"model": server.model, "input": "Hi",
                                                       "max_output_tokens": 2}, timeout=30)
    assert r.status_code == 401  # the key is checked here too
    assert json.loads(r.text)["error"]


def test_a_reply_sent_back_is_the_assistant_turn(server, client):
    kw = dict(model=server.model, max_output_tokens=3, temperature=0)
    first = client.responses.create(input="Hi", **kw)
    again = client.responses.create(input=[{"role": "user", "content": "Hi"}, *first.output,
                                           {"role": "user", "content": "More"}], **kw)
    chat = client.chat.completions.create(
        model=server.model, max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "More"}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    err = _refused(client.responses.create, input=[{"type": "reasoning", "id": "rs_1",
                                                    "summary": [{"type": "summary_text",
                                                                 "text": "x"}]}], **kw)
    assert err.param == "input" and err.body["message"].startswith("input.0.summary")


def test_text_format_json_schema_is_structured_output(server, client):
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "rec", "schema": schema, "strict": True}
    r = client.responses.create(model=server.model, input="A record:", max_output_tokens=200,
                                temperature=1.0, text={"format": fmt})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
