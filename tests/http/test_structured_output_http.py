"""Structured output with the official ``openai`` client against the session server (the demo
model: random weights, so only the grammar's token masks can make an output parse):
``response_format`` json_object and json_schema on chat, vLLM's ``structured_outputs``
(json, regex, choice, grammar) on completions and chat, streamed and with n > 1; an invalid
schema, regex or grammar is a 400 naming the field it came in."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

CHAT = [{"role": "user", "content": "Give me a record."}]
SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                         "name": {"type": "string", "maxLength": 8},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["cat", "dog"]}},
          "required": ["id", "name", "ok", "kind"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{1,6} \d{1,3}"
GRAMMAR = 'root ::= "[" item ("," item){0,3} "]"\nitem ::= [a-c] | "x" [0-9]'
GRAMMAR_RE = r"\[([a-c]|x\d)(,([a-c]|x\d)){0,3}\]"


def _chat(server, client, n=3, max_tokens=300, **kw):
    out = client.chat.completions.create(model=server.model, messages=CHAT, n=n, seed=11,
                                         max_tokens=max_tokens, **kw)
    assert all(c.finish_reason == "stop" for c in out.choices), out.choices
    return [c.message.content for c in out.choices]


def _completions(server, client, so, n=3, **kw):
    out = client.completions.create(model=server.model, prompt="Record:", max_tokens=300, n=n,
                                    seed=5, extra_body={"structured_outputs": so}, **kw)
    assert all(c.finish_reason == "stop" for c in out.choices), out.choices
    return [c.text for c in out.choices]


def _streamed_chat(server, client, n=2, **kw) -> list[str]:
    texts, finish = [""] * n, [None] * n
    for chunk in client.chat.completions.create(model=server.model, messages=CHAT,
                                                max_tokens=300, n=n, seed=11, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert finish == ["stop"] * n, (finish, texts)
    return texts


def test_json_schema_response_format(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA,
                                                  "strict": True}}
    texts = _chat(server, client, response_format=fmt)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, n=3: the mask constrains, it does not fix the text
    assert _streamed_chat(server, client, n=3, response_format=fmt) == texts


def test_json_object_response_format(server, client):
    # any object: random weights write long keys and strings (hundreds of tokens) before the
    # grammar lets the object close
    for text in _chat(server, client, n=2, max_tokens=1200,
                      response_format={"type": "json_object"}):
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_json_object_on_completions_and_chat(server, client):
    """vLLM's ``structured_outputs.json_object``: any JSON object, as ``response_format``
    json_object asks (the same constraint: the same seeded texts)."""
    so, fmt = {"json_object": True}, {"type": "json_object"}
    texts = []
    for extra in ({"structured_outputs": so}, {"response_format": fmt}):
        # seed 2 closes the object in about a hundred tokens (most take hundreds)
        out = client.completions.create(model=server.model, prompt="Record:", max_tokens=400,
                                        seed=2, extra_body=extra)
        assert out.choices[0].finish_reason == "stop", out.choices
        texts.append(out.choices[0].text)
    assert isinstance(json.loads(texts[0]), dict) and texts[0] == texts[1]
    (text,) = _chat(server, client, n=1, max_tokens=1200, extra_body={"structured_outputs": so})
    assert isinstance(json.loads(text), dict)
    assert [text] == _chat(server, client, n=1, max_tokens=1200, response_format=fmt)


def test_structured_outputs_json_on_completions_and_chat(server, client):
    for text in _completions(server, client, {"json": SCHEMA}):
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in _chat(server, client, extra_body={"structured_outputs": {
            "json": json.dumps(SCHEMA), "disable_any_whitespace": True}}):
        jsonschema.validate(json.loads(text), SCHEMA)  # no free whitespace: one layout
        assert text == json.dumps(json.loads(text), ensure_ascii=False)


def test_regex(server, client):
    for text in _completions(server, client, {"regex": REGEX}):
        assert re.fullmatch(REGEX, text), text
    streamed = _streamed_chat(server, client, extra_body={"structured_outputs": {"regex": REGEX}})
    assert all(re.fullmatch(REGEX, t) for t in streamed), streamed


def test_choice(server, client):
    choices = ["positive", "negative", "neutral"]
    got = _completions(server, client, {"choice": choices}, n=6)
    assert set(got) <= set(choices), got
    (greedy,) = _chat(server, client, n=1, temperature=0,
                      extra_body={"structured_outputs": {"choice": choices}})
    assert greedy in choices


def test_grammar(server, client):
    texts = _completions(server, client, {"grammar": GRAMMAR}, n=4)
    assert all(re.fullmatch(GRAMMAR_RE, t) for t in texts), texts
    streamed = _streamed_chat(server, client, extra_body={"structured_outputs": {
        "grammar": GRAMMAR}})
    assert all(re.fullmatch(GRAMMAR_RE, t) for t in streamed), streamed


def _refused(call, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    return e.value


@pytest.mark.parametrize("extra, param, says", [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs",
     "structured_outputs.regex is an invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs",
     "structured_outputs.grammar is an invalid grammar"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": 3}}}}},
     "structured_outputs", "structured_outputs.json is an invalid JSON schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "structured_outputs",
     "whitespace_pattern is not supported"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "does not support"),
    ({"guided_regex": "a"}, "guided_regex", "does not support"),  # vLLM's removed name
])
def test_invalid_structured_outputs_is_a_400(server, client, extra, param, says):
    for call, kw in ((client.completions.create, {"prompt": "Hi"}),
                     (client.chat.completions.create, {"messages": CHAT})):
        err = _refused(call, model=server.model, max_tokens=4, extra_body=extra, **kw)
        assert err.param == param and says in err.message, err.body


@pytest.mark.parametrize("fmt, says", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
     "response_format.json_schema.schema is an invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
    ({"type": "json_schema"}, "schema is required"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "json_schema"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_invalid_response_format_is_a_400(server, client, fmt, says):
    err = _refused(client.chat.completions.create, model=server.model, messages=CHAT,
                   max_tokens=4, response_format=fmt)
    assert err.param == "response_format" and says in err.message, err.body


def test_both_fields_at_once_is_a_400(server, client):
    err = _refused(client.chat.completions.create, model=server.model, messages=CHAT,
                   max_tokens=4, response_format={"type": "json_object"},
                   extra_body={"structured_outputs": {"regex": "a"}})
    assert err.param == "response_format" and "not both" in err.message, err.body


def test_text_response_format_changes_nothing(server, client):
    kw = dict(model=server.model, messages=CHAT, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    assert client.chat.completions.create(
        response_format={"type": "text"}, **kw).choices[0].message.content == plain
