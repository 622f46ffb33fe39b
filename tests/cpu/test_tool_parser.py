"""The hermes tool-call parser (deploy/tool_parser.py) on strings: a whole text's calls and
content, and the same text streamed in every split (two and three pieces, one character at a
time) adding up to exactly that, with no tag leaking into the content."""

from __future__ import annotations

import json

import pytest

from epserve.deploy.tool_parser import HermesToolStream, parse_tool_calls

ONE = ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
       '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
       '<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>\n')
TRICKY = ('<tool_call>{"name": "say", "arguments": {"text": "a \\"}\\" <tool_call> {[", '
          '"n": [1, {"b": null}]}}</tool_call>')


def _calls(parsed):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]


def test_one_call_with_content_before_it():
    p = parse_tool_calls(ONE)
    assert p.content == "Let me check.\n\n"  # as vLLM: the text before the call, as written
    assert _calls(p) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    (call,) = p.tool_calls
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")


def test_two_calls_and_whitespace_only_content_is_none():
    p = parse_tool_calls(TWO)
    assert p.content is None
    assert _calls(p) == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]
    ids = [c["id"] for c in p.tool_calls]
    assert len(set(ids)) == 2


def test_parallel_false_keeps_the_first_call_only():
    p = parse_tool_calls(TWO, parallel=False)
    assert _calls(p) == [("get_weather", '{"city": "Paris"}')] and p.content is None


def test_braces_quotes_and_tags_inside_strings_do_not_end_the_arguments():
    (name, args), = _calls(parse_tool_calls(TRICKY))
    assert name == "say"
    assert json.loads(args) == {"text": 'a "}" <tool_call> {[', "n": [1, {"b": None}]}


@pytest.mark.parametrize("text, args", [
    ('<tool_call>{"name": "f"}</tool_call>', "{}"),                     # no arguments
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', '{"x": 1}'),  # a string
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', '{"x": 1}'),    # the end, unclosed
])
def test_argument_forms(text, args):
    assert _calls(parse_tool_calls(text)) == [("f", args)]


@pytest.mark.parametrize("text", [
    "<tool_call>{name: get_weather}</tool_call>",          # not JSON
    '<tool_call>{"name": 3}</tool_call>',                   # name not a string
    '<tool_call>{"name": "f", "arguments": {"x": 1}',       # cut before the object closed
    '<tool_call>["f"]</tool_call>',                         # not an object
    "a < b <tool",                                          # a tag's start, then the end
    "plain text, no calls\n",
])
def test_what_is_not_a_call_is_content_as_written(text):
    p = parse_tool_calls(text)
    assert p.tool_calls == [] and p.content == text


def test_content_around_and_between_calls():
    text = 'A\n<tool_call>{"name": "f"}</tool_call>\n  \n<tool_call>{"name": "g"}</tool_call>\nB.'
    p = parse_tool_calls(text)
    assert p.content == "A\n\nB." and [n for n, _ in _calls(p)] == ["f", "g"]


# ---------------------------------------------------------------- streaming


def _stream(pieces: list[str], parallel: bool = True):
    s = HermesToolStream(parallel=parallel, eager=True)
    outs = [s.feed(p) for p in pieces] + [s.finish()]
    content = "".join(o.content for o in outs)
    deltas = [d for o in outs for d in o.deltas]
    return content, deltas, [o.content for o in outs]


def _assemble(deltas):
    """The calls a client builds from the deltas (the openai client's way), checking the
    order: a call's first delta has its id, type and name, later ones only arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        i = d["index"]
        if i not in calls:
            assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function"
            assert d["function"]["name"] and d["function"]["arguments"] == ""
            assert i == len(calls)  # indexes in order, from 0
            calls[i] = {"name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[i]["arguments"] += d["function"]["arguments"]
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def _splits(text: str):
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]
    yield list(text)  # one character at a time
    step = max(1, len(text) // 9)
    for k in range(1, len(text), step):
        for j in range(k, len(text), step):
            yield [text[:k], text[k:j], text[j:]]


@pytest.mark.parametrize("text", [ONE, TWO, TRICKY, 'x <tool_call>{"name": "f"}</tool_call> y',
                                  "<tool_call>{bad}</tool_call> and <tool_c", "a < b <tool"])
@pytest.mark.parametrize("parallel", [True, False])
def test_a_stream_in_any_pieces_adds_up_to_the_whole_text(text, parallel):
    whole = parse_tool_calls(text, parallel=parallel)
    for pieces in _splits(text):
        content, deltas, _ = _stream(pieces, parallel)
        assert content == (whole.content or ""), pieces
        assert _assemble(deltas) == _calls(whole), pieces


@pytest.mark.parametrize("text", [ONE, TWO, TRICKY])
def test_no_tag_character_leaks_into_streamed_content(text):
    for pieces in _splits(text):
        _, _, contents = _stream(pieces)
        assert all("<" not in c and ">" not in c for c in contents), pieces


def test_text_is_held_only_while_it_may_be_a_tag():
    s = HermesToolStream()
    assert s.feed("Hi <tool").content == "Hi "      # may become <tool_call>: held
    assert s.feed("box> ok").content == "<toolbox> ok"  # it did not: all of it now
    assert s.feed(" 1 < 2").content == " 1 < 2"      # a "<" followed by what no tag has
    assert s.finish().content == ""


def test_a_name_is_sent_before_its_arguments_complete():
    s = HermesToolStream()
    out = s.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert [d["function"] for d in out.deltas] == [{"name": "get_weather", "arguments": ""},
                                                   {"arguments": '{"ci'}]
    out = s.feed('ty": "Paris"}}</tool_call>')
    assert [d["function"] for d in out.deltas] == [{"arguments": 'ty": "Paris"}'}]
    assert s.finish().content == ""
