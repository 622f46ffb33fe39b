"""Reasoning on /v1/chat/completions as a vLLM user gets it (``--reasoning-parser qwen3``), and
``chat_template_kwargs``, with the openai client against the scripted server (conftest): after
the generation prompt its model thinks (``<think>...</think>``) and then calls a tool; with
``enable_thinking`` false the template closes the thinking block itself and the model answers;
after a prefilled ``<think>[[implicit]]`` it finishes its thinking (no ``<think>`` in its own
output) and answers."""

from __future__ import annotations

import openai
import pytest
from scripted_model import REASONING

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
IMPLICIT = dict(messages=ASK + [{"role": "assistant", "content": "<think>[[implicit]]"}],
                extra_body={"add_generation_prompt": False, "continue_final_message": True})


def _extra(message_or_delta, name: str):
    return (message_or_delta.model_extra or {}).get(name)


def _stream(client, **kw) -> tuple[str, str, str, list]:
    """(reasoning_content, reasoning, content, deltas) of a streamed single choice."""
    deltas = [c.delta for ch in client.chat.completions.create(stream=True, **kw)
              for c in ch.choices]
    return ("".join(_extra(d, "reasoning_content") or "" for d in deltas),
            "".join(_extra(d, "reasoning") or "" for d in deltas),
            "".join(d.content or "" for d in deltas), deltas)


def test_thinking_is_reasoning_content_not_content(scripted_server, scripted_client):
    out = scripted_client.chat.completions.create(model=scripted_server.model, messages=ASK,
                                                  max_tokens=64)
    msg = out.choices[0].message
    # vLLM's names: reasoning_content and (since 0.11) reasoning, the same text
    assert _extra(msg, "reasoning_content") == _extra(msg, "reasoning") == REASONING
    # no tools in the request: what follows the thinking is content, as written
    assert msg.content.startswith("\n\n<tool_call>") and "think>" not in msg.content
    assert out.choices[0].finish_reason == "stop"


def test_streamed_reasoning_adds_up_and_no_tag_leaks(scripted_server, scripted_client):
    whole = scripted_client.chat.completions.create(model=scripted_server.model, messages=ASK,
                                                    max_tokens=64).choices[0].message
    reasoning_content, reasoning, content, deltas = _stream(
        scripted_client, model=scripted_server.model, messages=ASK, max_tokens=64)
    assert reasoning_content == reasoning == REASONING and content == whole.content
    for d in deltas:
        for text in (_extra(d, "reasoning_content") or "", d.content or ""):
            assert "<think>" not in text and "</think>" not in text


def test_the_end_of_a_thinking_block_the_prompt_opened(scripted_server, scripted_client):
    kw = dict(model=scripted_server.model, max_tokens=64, **IMPLICIT)
    msg = scripted_client.chat.completions.create(**kw).choices[0].message
    assert _extra(msg, "reasoning_content") == " so the answer is 4."
    assert msg.content == "\n\nThe answer is 4."
    reasoning_content, _, content, _ = _stream(scripted_client, **kw)
    assert (reasoning_content, content) == (" so the answer is 4.", "\n\nThe answer is 4.")


def test_chat_template_kwargs_reach_the_template(scripted_server, scripted_client):
    kw = dict(model=scripted_server.model, messages=ASK, max_tokens=64)
    on = scripted_client.chat.completions.create(**kw)
    off = scripted_client.chat.completions.create(
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw)
    # the template closed the thinking block itself: "<think>\n\n</think>\n\n" more prompt
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    msg = off.choices[0].message
    assert msg.content == "It is sunny in Paris today." and _extra(msg, "reasoning") is None
    _, reasoning, content, _ = _stream(
        scripted_client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw)
    assert (reasoning, content) == ("", "It is sunny in Paris today.")


@pytest.mark.parametrize("kwargs, says", [
    ({"no_such_switch": True}, "does not use it"),           # the template never reads it
    ({"tokenize": True}, "cannot be set here"),               # apply_chat_template's own
    ({"add_generation_prompt": False}, "request's own field"),
])
def test_chat_template_kwargs_the_template_would_drop_are_refused(
        scripted_server, scripted_client, kwargs, says):
    with pytest.raises(openai.BadRequestError) as e:
        scripted_client.chat.completions.create(
            model=scripted_server.model, messages=ASK, max_tokens=2,
            extra_body={"chat_template_kwargs": kwargs})
    assert e.value.param == "chat_template_kwargs" and says in e.value.message, e.value.body


def test_a_template_without_thinking_refuses_enable_thinking(server, client):
    # the demo model's template has no enable_thinking: accepting it would change nothing
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs":
                                                   {"enable_thinking": False}})
    assert e.value.param == "chat_template_kwargs" and "enable_thinking" in e.value.message


def test_without_a_reasoning_parser_the_text_is_content(server, client):
    out = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4,
                                         temperature=0)
    msg = out.choices[0].message
    assert msg.content and _extra(msg, "reasoning_content") is None
