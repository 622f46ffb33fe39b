"""``response_format`` on /v1/completions, as vLLM serves it (structured output on completions
too), with the official openai client (whose ``completions.create`` has no such keyword: it
travels in ``extra_body``, as a vLLM user sends it): json_schema and json_object outputs parse
and match on the random demo model, whole, streamed and with n > 1; ``text`` changes nothing;
an invalid format, or both constraint fields at once, is a 400 naming ``response_format``."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                         "name": {"type": "string", "maxLength": 8},
                         "kind": {"enum": ["cat", "dog"]}},
          "required": ["id", "name", "kind"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA,
                                                 "strict": True}}


def _create(server, client, fmt, **kw):
    kw.setdefault("max_tokens", 300)
    kw.setdefault("seed", 5)
    return client.completions.create(model=server.model, prompt="Record:",
                                     extra_body={"response_format": fmt}, **kw)


def test_json_schema_on_completions(server, client):
    out = _create(server, client, FORMAT, n=3)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert all(c.finish_reason == "stop" for c in out.choices), out.choices
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, n=3: the mask constrains, it does not fix the text
    streamed = [""] * 3
    for chunk in _create(server, client, FORMAT, n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts


def test_json_object_on_completions(server, client):
    # any object: random weights write long keys and strings before the object may close
    # (most seeds take hundreds of tokens; seed 2 closes it in about a hundred)
    out = _create(server, client, {"type": "json_object"}, seed=2, max_tokens=400)
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_text_format_changes_nothing(server, client):
    plain = client.completions.create(model=server.model, prompt="Record:", max_tokens=8,
                                      temperature=0).choices[0].text
    assert _create(server, client, {"type": "text"}, max_tokens=8,
                   temperature=0).choices[0].text == plain


@pytest.mark.parametrize("extra, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema is an invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
     "not both"),
])
def test_an_invalid_format_is_a_400_naming_it(server, client, extra, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="Record:", max_tokens=4,
                                  extra_body=extra)
    assert e.value.param == "response_format" and says in e.value.message, e.value.body
