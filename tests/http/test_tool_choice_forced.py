"""``tool_choice`` ``required`` and a named function with the official ``openai`` client (and the
Responses and Anthropic routes), forced with structured output as vLLM serves them.

The server here runs the demo model (random weights: only the grammar's token masks can make
its output a call that parses) behind a chat template that renders tools, and without vLLM's
tool flags: a forced choice needs none. A named function's output is held to that tool's
schema and comes back as one call (``finish_reason`` ``stop``); ``required``'s is a JSON array
of calls, each one of the tools with its arguments (``finish_reason`` ``tool_calls``; one call
with ``parallel_tool_calls`` false). Streamed, the calls' id and name come first, then the
arguments, adding up to the whole answer's (same seed). A named function not among the tools,
or a forced choice together with the request's own structured output, is a 400 naming both.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import json
import shutil

import anthropic
import jsonschema
import openai
import pytest
from scripted_model import TEMPLATE
from serverkit import API_KEY, Server, remove_side_app, side_app, side_app_base

APP, HEAD, PREFIX = "epserve-http-forced", "epserve-head-forced", "/forced"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {
    "zone": {"enum": ["UTC", "CET"]}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["zone", "hour"], "additionalProperties": False}
# a $ref into its own $defs: with "required" the tools' definitions move to the array's root
ALARM = {"type": "object", "$defs": {"Clock": {
    "type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23},
                                     "on": {"type": "boolean"}},
    "required": ["h", "on"], "additionalProperties": False}},
    "properties": {"at": {"$ref": "#/$defs/Clock"}}, "required": ["at"],
    "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "set_alarm": ALARM}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool",
                                           "parameters": s}} for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _forced_config(getfixture) -> dict:
    """The demo model behind a template that renders tools, served without the tool flags."""
    folder = getfixture("tmp_path_factory").mktemp("forced") / "model"
    shutil.copytree(getfixture("demo_model_dir"), folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return {"model": str(folder), "dtype": "float32", "seed": 0, "max_num_seqs": 8,
            "served_model_name": "forced", "api_key": API_KEY, "head_name": HEAD}


side_app("forced_server", APP, PREFIX, _forced_config)


@pytest.fixture(scope="module")
def forced_server(server, request) -> Server:
    """The demo model behind a template that renders tools, served without the tool flags."""
    base = side_app_base("forced_server", server, request.getfixturevalue, "the forced app")
    yield Server(base, "forced", API_KEY)
    remove_side_app("forced_server")


@pytest.fixture(scope="module")
def fclient(forced_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=forced_server.v1, api_key=API_KEY, max_retries=0,
                         timeout=120)


def _create(srv, client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("tools", TOOLS)
    kw.setdefault("max_tokens", 400)
    kw.setdefault("seed", 7)
    return client.chat.completions.create(model=srv.model, **kw)


def _valid_call(name: str, arguments: str) -> dict:
    """The call's arguments as JSON, checked against its tool's schema."""
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def _stream(srv, client, **kw):
    """(content, calls as (name, arguments), finish reason per choice) of a streamed answer."""
    n = kw.get("n", 1)
    content, calls, finish = [""] * n, [{} for _ in range(n)], [None] * n
    for ch in _create(srv, client, stream=True, **kw):
        for c in ch.choices:
            k, d = c.index, c.delta
            content[k] += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls[k]:  # a call's first delta: its id, type and name
                    assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function"
                    assert tc.function.name and tc.index == len(calls[k])
                    calls[k][tc.index] = [tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None
                calls[k][tc.index][1] += tc.function.arguments or ""
            finish[k] = c.finish_reason or finish[k]
    return content, [[tuple(v) for _, v in sorted(c.items())] for c in calls], finish


def _whole_calls(choice) -> list[tuple[str, str]]:
    calls = choice.message.tool_calls or []
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    return [(c.function.name, c.function.arguments) for c in calls]


# ---------------------------------------------------------------- a named function


def test_named_function_is_one_call_to_it(forced_server, fclient):
    out = _create(forced_server, fclient, tool_choice=NAMED, n=3)
    args = []
    for choice in out.choices:
        assert choice.finish_reason == "stop"  # vLLM's for a named function
        assert choice.message.content == ""
        (call,) = _whole_calls(choice)
        assert call[0] == "get_weather"
        args.append(_valid_call(*call))
    assert len({json.dumps(a, sort_keys=True) for a in args}) > 1  # sampled, not fixed


def test_named_function_streamed_adds_up_to_the_whole_call(forced_server, fclient):
    whole = _create(forced_server, fclient, tool_choice=NAMED, n=2)
    content, calls, finish = _stream(forced_server, fclient, tool_choice=NAMED, n=2)
    assert finish == ["stop", "stop"] and content == ["", ""]
    assert calls == [_whole_calls(c) for c in whole.choices]
    for (call,) in calls:
        _valid_call(*call)


def test_a_tool_without_parameters_gets_empty_arguments(forced_server, fclient):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    out = _create(forced_server, fclient, tools=tools,
                  tool_choice={"type": "function", "function": {"name": "ping"}})
    ((name, arguments),) = _whole_calls(out.choices[0])
    assert name == "ping" and json.loads(arguments) == {}  # whitespace as the model wrote it


def test_named_function_works_beside_the_servers_tool_parser(scripted_server,
                                                               scripted_client):
    # the scripted server runs --enable-auto-tool-choice --tool-call-parser hermes
    # --reasoning-parser qwen3: the forced output is still the call, not hermes tags
    out = _create(scripted_server, scripted_client, tool_choice=NAMED, max_tokens=200)
    (choice,) = out.choices
    assert choice.finish_reason == "stop" and not choice.message.model_extra.get("reasoning")
    (call,) = _whole_calls(choice)
    _valid_call(*call)


# ---------------------------------------------------------------- required


# random weights: an array of calls ends only when "]" is drawn among the whitespace and ","
LONG = 2000
# a seed whose two answers hold two calls and one (seed 7's held 5 and 3, in 934 tokens)
REQUIRED_SEED = 1


def test_required_is_calls_to_real_tools_streamed_or_not(forced_server, fclient):
    kw = dict(tool_choice="required", n=2, max_tokens=LONG, seed=REQUIRED_SEED)
    out = _create(forced_server, fclient, **kw)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        calls = _whole_calls(choice)
        assert calls
        for call in calls:
            _valid_call(*call)
    whole = [_whole_calls(c) for c in out.choices]
    assert max(len(c) for c in whole) > 1  # a later call's deltas are streamed too
    # streamed (same seed): each call's id and name first, then its arguments, adding up
    content, calls, finish = _stream(forced_server, fclient, **kw)
    assert finish == ["tool_calls", "tool_calls"] and content == ["", ""]
    assert calls == whole


def test_required_without_parallel_calls_is_one_call(forced_server, fclient):
    out = _create(forced_server, fclient, tool_choice="required", parallel_tool_calls=False,
                  n=4)
    for choice in out.choices:
        (call,) = _whole_calls(choice)
        _valid_call(*call)
    _, calls, _ = _stream(forced_server, fclient, tool_choice="required",
                          parallel_tool_calls=False, n=2)
    assert [len(c) for c in calls] == [1, 1]


def test_strict_tools_are_served_when_the_call_is_forced(forced_server, fclient):
    strict = [{"type": "function", "function": {**t["function"], "strict": True}}
              for t in TOOLS]
    out = _create(forced_server, fclient, tools=strict, tool_choice="required",
                  parallel_tool_calls=False)
    for call in _whole_calls(out.choices[0]):
        _valid_call(*call)


# ---------------------------------------------------------------- the other routes


def test_responses_api_forced_tool_choice(forced_server, fclient):
    tools = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
    kw = dict(model=forced_server.model, input="Weather?", tools=tools, max_output_tokens=400)
    r = fclient.responses.create(tool_choice={"type": "function", "name": "get_time"}, **kw)
    assert r.status == "completed" and [i.type for i in r.output] == ["function_call"]
    assert r.output[0].name == "get_time" and r.tool_choice.name == "get_time"
    _valid_call(r.output[0].name, r.output[0].arguments)
    r = fclient.responses.create(tool_choice="required", **kw)
    assert r.output and all(i.type == "function_call" for i in r.output)
    for item in r.output:
        _valid_call(item.name, item.arguments)
    with fclient.responses.stream(tool_choice="required", **kw) as stream:
        final = stream.get_final_response()
    assert final.output and all(i.type == "function_call" for i in final.output)
    for item in final.output:
        _valid_call(item.name, item.arguments)


def test_responses_api_parallel_tool_calls_false_is_one_call(forced_server, fclient):
    """``required`` sampled (the Responses API takes no seed) most often makes several calls
    (2-5 in each of 4 tries when measured); with ``parallel_tool_calls`` false each answer is
    one call, whole and streamed, and the response echoes the field."""
    tools = [{"type": "function", "name": n, "parameters": s} for n, s in SCHEMAS.items()]
    kw = dict(model=forced_server.model, input="Weather?", tools=tools, tool_choice="required",
              max_output_tokens=LONG)
    with ThreadPoolExecutor(7) as pool:  # at once: one batch on the server, not 7 in a row
        tries = [pool.submit(fclient.responses.create, **kw) for _ in range(4)]
        ones = [pool.submit(fclient.responses.create, parallel_tool_calls=False, **kw)
                for _ in range(3)]
    assert any(len(r.output) > 1 and r.parallel_tool_calls is True
               for r in (t.result() for t in tries))
    for one in (o.result() for o in ones):
        assert [i.type for i in one.output] == ["function_call"] and one.status == "completed"
        assert one.parallel_tool_calls is False
        _valid_call(one.output[0].name, one.output[0].arguments)
    with fclient.responses.stream(parallel_tool_calls=False, **kw) as stream:
        final = stream.get_final_response()
    assert [i.type for i in final.output] == ["function_call"]
    _valid_call(final.output[0].name, final.output[0].arguments)


def test_anthropic_forced_tool_choice(forced_server):
    claude = anthropic.Anthropic(base_url=forced_server.base, api_key=API_KEY, max_retries=0,
                                 timeout=120)
    tools = [{"name": n, "input_schema": s} for n, s in SCHEMAS.items()]
    kw = dict(model=forced_server.model, messages=ASK, tools=tools, max_tokens=400)
    msg = claude.messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].name == "get_weather"
    jsonschema.validate(msg.content[0].input, WEATHER)
    with claude.messages.stream(tool_choice={"type": "any",
                                             "disable_parallel_tool_use": True}, **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    jsonschema.validate(final.content[0].input, SCHEMAS[final.content[0].name])
    broken = tools + [{"name": "broken", "input_schema": {"type": "object", "properties": {
        "x": {"type": 3}}}}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**{**kw, "tools": broken},
                               tool_choice={"type": "tool", "name": "broken"})
    assert "tools.3.input_schema" in e.value.body["error"]["message"], e.value.body


# ---------------------------------------------------------------- refusals


def _refused(call, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    return e.value


def test_a_named_function_not_among_the_tools_is_a_400(forced_server, fclient):
    err = _refused(_create, srv=forced_server, client=fclient, max_tokens=2,
                   tool_choice={"type": "function", "function": {"name": "get_stock"}})
    assert err.param == "tool_choice" and "'get_stock'" in err.message, err.body
    assert "'get_weather'" in err.message  # and what the tools are
    err = _refused(_create, srv=forced_server, client=fclient, max_tokens=2, tools=[],
                   tool_choice="required")
    assert err.param == "tools", err.body


@pytest.mark.parametrize("choice", ["required", NAMED])
@pytest.mark.parametrize("own, field", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}}, "structured_outputs")])
def test_a_forced_choice_with_the_requests_own_structured_output_is_a_400(
        forced_server, fclient, choice, own, field):
    err = _refused(_create, srv=forced_server, client=fclient, max_tokens=2,
                   tool_choice=choice, **own)
    assert err.param == "tool_choice" and field in err.message, err.body
    assert "tool_choice" in err.message and "cannot be combined" in err.message


def test_responses_refusals_name_the_responses_fields(forced_server, fclient):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    err = _refused(fclient.responses.create, model=forced_server.model, input="Hi",
                   tools=tools, tool_choice="required", text={"format": {"type": "json_object"}},
                   max_output_tokens=2)
    assert err.param == "tool_choice" and "text.format" in err.message, err.body
    broken = tools + [{"type": "function", "name": "broken",
                       "parameters": {"type": "object", "properties": {"x": {"type": 3}}}}]
    err = _refused(fclient.responses.create, model=forced_server.model, input="Hi",
                   tools=broken, tool_choice="required", max_output_tokens=2)
    assert err.param == "tools" and "tools.1.parameters " in err.message, err.body


def test_tool_schemas_a_forced_call_cannot_use_are_400s_naming_them(forced_server, fclient):
    bad = [TOOLS[0], {"type": "function", "function": {
        "name": "broken", "parameters": {"type": "object", "properties": {"x": {"type": 3}}}}}]
    for choice in ("required", {"type": "function", "function": {"name": "broken"}}):
        err = _refused(_create, srv=forced_server, client=fclient, max_tokens=2, tools=bad,
                       tool_choice=choice)
        assert err.param == "tools" and "tools.1.function.parameters" in err.message, err.body
    other = {"type": "object", "$defs": {"Clock": {"type": "string"}},
             "properties": {"at": {"$ref": "#/$defs/Clock"}}}
    clash = TOOLS + [{"type": "function", "function": {"name": "other", "parameters": other}}]
    err = _refused(_create, srv=forced_server, client=fclient, max_tokens=2, tools=clash,
                   tool_choice="required")
    assert err.param == "tools" and "tools.3.function.parameters.$defs.Clock" in err.message
    # one tool alone is served: its $defs stay where its $refs point
    out = _create(forced_server, fclient, tools=clash[3:],
                  tool_choice={"type": "function", "function": {"name": "other"}},
                  max_tokens=2)
    assert out.choices[0].message.tool_calls[0].function.name == "other"
