"""Reasoning and structured output together, as vLLM serves them (``--reasoning-parser``): the
grammar of a ``response_format`` holds only once the reasoning has ended, so the model thinks
freely and then writes the JSON; the reasoning comes back as ``reasoning_content`` and the
JSON as the content. With the openai client against the scripted server (conftest): its model
thinks ``<think>...</think>`` after the generation prompt; with ``enable_thinking`` false the
template closes the thinking block in the prompt, so the grammar holds from the first token."""

from __future__ import annotations

import json

import jsonschema
from scripted_model import REASONING

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"sky": {"enum": ["clear", "rain"]}},
          "required": ["sky"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}


def _extra(message_or_delta, name: str):
    return (message_or_delta.model_extra or {}).get(name)


def test_the_schema_holds_after_the_thinking(scripted_server, scripted_client):
    kw = dict(model=scripted_server.model, messages=ASK, max_tokens=60, temperature=0,
              response_format=FORMAT)
    out = scripted_client.chat.completions.create(**kw).choices[0]
    assert _extra(out.message, "reasoning_content") == REASONING
    jsonschema.validate(json.loads(out.message.content), SCHEMA)
    assert out.finish_reason == "stop"
    deltas = [c.delta for ch in scripted_client.chat.completions.create(stream=True, **kw)
              for c in ch.choices]
    assert "".join(_extra(d, "reasoning_content") or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == out.message.content


def test_a_thinking_block_the_prompt_closed_lets_the_schema_hold_at_once(scripted_server,
                                                                          scripted_client):
    out = scripted_client.chat.completions.create(
        model=scripted_server.model, messages=ASK, max_tokens=60, temperature=0,
        response_format=FORMAT,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert _extra(out.message, "reasoning_content") is None
    jsonschema.validate(json.loads(out.message.content), SCHEMA)
