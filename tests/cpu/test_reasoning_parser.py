"""The reasoning parsers (deploy/reasoning_parser.py) on strings, and a chat choice's whole
parse (deploy/chat_output.py: reasoning first, tool calls in the content after it), whole and
streamed in every split; and what a request's tool fields ask of the server (vLLM's checks)."""

from __future__ import annotations

import pytest

from epserve.deploy.chat_output import (
    AUTO_NEEDS_FLAGS, ChatParsing, choice_parser, reply_starts_thinking, tool_plan,
)
from epserve.deploy.errors import ApiError
from epserve.deploy.openai_models import ChatCompletionRequest, validate
from epserve.deploy.reasoning_parser import (
    ReasoningSplitter, prompt_opens_thinking, split_reasoning, starts_in_reasoning,
)


@pytest.mark.parametrize("text, in_reasoning, reasoning, content", [
    ("<think>\nabc\n</think>\n\nThe answer.", False, "\nabc\n", "\n\nThe answer."),
    ("\n<think>abc</think>x", False, "abc", "x"),        # whitespace before <think>: dropped
    ("<think>abc (cut by max_tokens)", False, "abc (cut by max_tokens)", None),
    ("The answer.", False, None, "The answer."),          # neither tag: all content
    ("a </think> b", False, None, "a </think> b"),        # no thinking began: text
    ("<thinking> is a word", False, None, "<thinking> is a word"),
    ("abc</think>The answer.", True, "abc", "The answer."),  # the prompt opened <think>
    ("still thinking", True, "still thinking", None),
    ("<think></think>x", False, None, "x"),
])
def test_split(text, in_reasoning, reasoning, content):
    assert split_reasoning(text, in_reasoning) == (reasoning, content)


def test_the_prompt_decides_whether_the_reply_starts_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("user: what is <think>?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_opens_thinking("...", final_message="<think>\nLet me see")
    assert not prompt_opens_thinking("...", final_message="<think>a</think>b")
    assert starts_in_reasoning("deepseek_r1", "<|im_start|>assistant\n")  # R1 always thinks
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n")


@pytest.mark.parametrize("text, in_reasoning", [
    ("<think>\nabc\n</think>\n\nThe answer.", False), ("  <think>a</thin</think>b", False),
    ("x</think>y", True), ("<thi", False), ("ab</thi", True), ("plain", False)])
def test_a_stream_in_any_pieces_splits_as_the_whole_text(text, in_reasoning):
    want = split_reasoning(text, in_reasoning)
    for k in range(len(text) + 1):
        for j in range(k, len(text) + 1):
            s = ReasoningSplitter(in_reasoning)
            parts = [s.feed(text[:k]), s.feed(text[k:j]), s.feed(text[j:]), s.finish()]
            got = ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None)
            assert got == want, (k, j)
            assert not any(t in r + c for r, c in parts for t in ("<think>", "</think>"))


def test_reasoning_is_sent_as_it_comes_and_only_a_possible_tag_is_held():
    s = ReasoningSplitter(False)
    assert s.feed("<think>I am thinking</th") == ("I am thinking", "")
    assert s.feed("ree things") == ("</three things", "")
    assert s.feed("</think>Done") == ("", "Done")
    assert s.finish() == ("", "")


# ---------------------------------------------------------------- a chat choice, whole


PARSING = ChatParsing(True, "hermes", "qwen3")
REPLY = ('<think>\nThe user wants Paris.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
         '"arguments": {"city": "Paris"}}\n</tool_call>')


def _req(**body):
    req = validate(ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}],
                                           **body})
    req.check()
    return req


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_reasoning_then_a_call_whole_and_streamed():
    plan = tool_plan(_req(tools=TOOLS), PARSING)
    msg = choice_parser(PARSING, plan, False, whole=True).message(REPLY)
    assert msg["reasoning_content"] == msg["reasoning"] == "\nThe user wants Paris.\n"
    assert msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    for k in range(1, len(REPLY)):
        p = choice_parser(PARSING, plan, False, whole=False)
        deltas = [p.step(REPLY[:k], False), p.step(REPLY[k:], True)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning"]
        assert "".join(d.get("content", "") for d in deltas) == ""
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "get_weather"
        assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
        assert p.finish_reason("stop") == "tool_calls"


def test_without_parsers_the_message_is_the_text():
    plan = tool_plan(_req(), ChatParsing())
    p = choice_parser(ChatParsing(), plan, False, whole=True)
    msg = p.message(REPLY)
    assert msg["content"] == REPLY and msg["tool_calls"] == [] and msg["reasoning"] is None
    assert p.finish_reason("stop") == "stop"


def test_tool_choice_none_renders_the_tools_and_parses_nothing():
    plan = tool_plan(_req(tools=TOOLS, tool_choice="none"), PARSING)
    assert plan.render == TOOLS and not plan.parse
    msg = choice_parser(PARSING, plan, False, whole=True).message(REPLY)
    assert msg["tool_calls"] == [] and msg["content"].lstrip().startswith("<tool_call>")


def test_reply_starts_thinking_after_a_prefilled_think():
    req = _req(messages=[{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "<think>Hmm"}],
               add_generation_prompt=False, continue_final_message=True)
    assert reply_starts_thinking(PARSING, "...<think>Hmm", req)
    assert not reply_starts_thinking(ChatParsing(), "...<think>Hmm", req)


# ---------------------------------------------------------------- the request's tool fields


def _refused(parsing: ChatParsing, **body) -> ApiError:
    with pytest.raises(ApiError) as e:
        tool_plan(_req(**body), parsing)
    assert e.value.status == 400
    return e.value


def test_auto_needs_the_server_flags_as_in_vllm():
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        err = _refused(ChatParsing(), **body)
        assert err.message == AUTO_NEEDS_FLAGS and err.param == "tool_choice"
    assert tool_plan(_req(tools=TOOLS), PARSING).parse


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_choices_are_forced_calls_without_the_server_flags(choice):
    """As vLLM: no --enable-auto-tool-choice needed; the output is constrained (structured
    output), not parsed for <tool_call> tags."""
    plan = tool_plan(_req(tools=TOOLS, tool_choice=choice), ChatParsing())
    assert plan.forced is not None and not plan.parse and plan.constraint is not None


def test_other_tool_field_errors():
    assert _refused(PARSING, tool_choice="auto").param == "tool_choice"  # no tools
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    assert _refused(PARSING, tools=strict).param == "tools"
    assert not tool_plan(_req(tools=TOOLS, parallel_tool_calls=False), PARSING).parallel


def test_history_tool_calls_reach_the_template_as_json_values():
    req = _req(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"}])
    assistant, tool = (m.to_template() for m in req.messages[1:])
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tool["tool_call_id"] == "c1" and tool["content"] == "22 C"
    bad = _req(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}])
    with pytest.raises(ApiError) as e:
        bad.messages[0].to_template("messages.0")
    assert "messages.0.tool_calls.0.function.arguments" in e.value.message
