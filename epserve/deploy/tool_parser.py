"""The ``hermes`` tool-call parser (vLLM's ``--tool-call-parser hermes``, the format of Qwen2.5,
Qwen3 and Hermes models): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
in a choice's content become OpenAI tool calls, whole or as the text streams.

Invariants:
- a block is a call when its body is one JSON object with a string ``name``; its
  ``arguments`` are the object's ``arguments`` value as the model wrote it (a string value is
  taken as the JSON text it holds; none is ``{}``). Any other block is content, tags and all;
- content is the text outside the calls, less any stretch of it that is only whitespace and
  touches a call (so ``"\\n\\n<tool_call>..."`` is a call and no content, and ``"Sure.\\n\\n
  <tool_call>..."`` keeps ``"Sure.\\n\\n"`` as vLLM does); None when empty;
- ``parallel=False`` keeps the first call only (later blocks that are calls are dropped);
- streaming (``eager``) sends a call's id, type and name once its name is read, then its
  arguments as they arrive; it never sends a character of a tag as content: a text that may
  still become ``<tool_call>`` is held until decided. A stream of valid calls, fed in any
  pieces, adds up to exactly what the whole text gives (names, arguments, content).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from epserve.deploy.reasoning_parser import held_suffix

CALL_START, CALL_END = "<tool_call>", "</tool_call>"

#: vLLM's names for the tool-call parsers this server has.
TOOL_PARSERS = ("hermes",)


def new_call_id() -> str:
    """A tool call's id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class CallScanner:
    """One block's body read as it arrives, at the top level of a JSON object: the ``name``
    once its string is complete, and where the ``args_key`` value (``arguments``) starts and
    ends."""

    def __init__(self, args_key: str = "arguments") -> None:
        self.args_key = args_key
        self.text = ""
        self.state = "pre"  # pre key colon value in_value scalar after done bad
        self.depth = 0
        self._in_str = self._esc = False
        self._key: str | None = None
        self._start = 0
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_kind = ""  # "{", "[", '"' or "scalar"

    def feed(self, text: str) -> None:
        base = len(self.text)
        self.text += text
        for k, c in enumerate(text):
            if self.state == "bad":
                return
            self._step(base + k, c)

    def _step(self, i: int, c: str) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self.state == "key":
                    self._key = _loads(self.text[self._start:i + 1])
                    self.state = "colon"
                elif self.state == "in_value" and self.depth == 1:
                    self._value_end(i + 1)
            return
        st = self.state
        if st == "scalar":
            if c in ",}" or c.isspace():
                self._value_end(i)
                st = self.state
            else:
                return
        if c.isspace() and st != "in_value":
            return
        if st == "pre":
            self.state, self.depth = ("key", 1) if c == "{" else ("bad", 0)
        elif st == "key":
            if c == '"':
                self._in_str, self._start = True, i
            elif c == "}":  # {} (or a trailing comma: json.loads refuses it later)
                self.state, self.depth = "done", 0
            else:
                self.state = "bad"
        elif st == "colon":
            self.state = "value" if c == ":" else "bad"
        elif st == "value":
            self._start = i
            if self._key == self.args_key:
                self.args_start, self.args_kind = i, c if c in '{["' else "scalar"
            if c == '"':
                self._in_str, self.state = True, "in_value"
            elif c in "{[":
                self.depth, self.state = self.depth + 1, "in_value"
            else:
                self.state = "scalar"
        elif st == "in_value":
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_end(i + 1)
        elif st == "after":
            if c == ",":
                self.state = "key"
            elif c == "}":
                self.state, self.depth = "done", 0
            else:
                self.state = "bad"
        elif st == "done":
            self.state = "bad"

    def _value_end(self, end: int) -> None:
        if self._key == "name" and self.text[self._start] == '"' and self.name is None:
            self.name = _loads(self.text[self._start:end])
        if self._key == self.args_key:
            self.args_end = end
        self.state, self._key = "after", None


def _loads(s: str) -> Any:
    try:
        return json.loads(s)
    except ValueError:
        return None


@dataclass
class _Call:
    id: str
    name: str
    sent_args: str = ""


@dataclass
class ToolOutput:
    """What one piece of text (or the end) gave: content and tool-call deltas (OpenAI's
    streamed ``delta.tool_calls`` entries)."""

    content: str = ""
    deltas: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: "ToolOutput") -> None:
        self.content += other.content
        self.deltas.extend(other.deltas)


class HermesToolStream:
    """One choice's content, fed in pieces, turned into content and tool calls."""

    def __init__(self, parallel: bool = True, eager: bool = True):
        self.parallel, self.eager = parallel, eager
        self.calls: list[_Call] = []
        self._buf = ""
        self._scan: CallScanner | None = None  # the open block's, when in one
        self._block_call: _Call | None = None  # the open block's call once sent
        self._ws = ""             # the current stretch of content, while only whitespace
        self._seg_text = False    # the current stretch has more than whitespace
        self._out = ToolOutput()

    def feed(self, text: str) -> ToolOutput:
        self._buf += text
        while True:
            if self._scan is None:
                i = self._buf.find(CALL_START)
                if i < 0:
                    keep = held_suffix(self._buf, CALL_START)
                    self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._content(self._buf[:i])
                self._buf = self._buf[i + len(CALL_START):]
                self._scan, self._block_call = CallScanner(), None
            else:
                j = self._buf.find(CALL_END)
                if j < 0:
                    keep = held_suffix(self._buf, CALL_END)
                    self._body(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._body(self._buf[:j])
                self._buf = self._buf[j + len(CALL_END):]
                self._close(closed=True)
        return self._take()

    def finish(self) -> ToolOutput:
        """The end of the text: an open block is closed, held text decided."""
        rest, self._buf = self._buf, ""
        if self._scan is not None:
            self._body(rest)
            self._close(closed=False)
        else:
            self._content(rest)
        if not self.calls:  # whitespace next to no call is content
            self._out.content += self._ws
        self._ws = ""
        return self._take()

    def _take(self) -> ToolOutput:
        out, self._out = self._out, ToolOutput()
        return out

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._seg_text:
            self._out.content += text
            return
        self._ws += text
        if self._ws.strip():
            self._out.content += self._ws
            self._ws, self._seg_text = "", True

    def _after_call(self) -> None:
        """A call ended a stretch of content: whitespace only next to it is dropped."""
        self._ws, self._seg_text = "", False

    def _allowed(self) -> bool:
        return self.parallel or not self.calls

    def _body(self, text: str) -> None:
        scan = self._scan
        assert scan is not None
        scan.feed(text)
        if not self.eager or scan.state == "bad":
            return
        if self._block_call is None and scan.name is not None and self._allowed():
            self._block_call = self._start_call(scan.name)
        call = self._block_call
        if call is not None and scan.args_kind in ("{", "[") and scan.args_start is not None:
            end = scan.args_end if scan.args_end is not None else len(scan.text)
            self._send_args(call, scan.text[scan.args_start:end])

    def _close(self, closed: bool) -> None:
        scan, call = self._scan, self._block_call
        assert scan is not None
        self._scan = self._block_call = None
        args = _final_args(scan)
        if call is None:
            if args is None:  # not a call: the block is content, as written
                self._content(CALL_START + scan.text + (CALL_END if closed else ""))
                return
            if not self._allowed():
                self._after_call()  # parallel_tool_calls false: a later call is dropped
                return
            call = self._start_call(scan.name or "")
        if args is not None:
            self._send_args(call, args)
        self._after_call()

    def _start_call(self, name: str) -> _Call:
        call = _Call(new_call_id(), name)
        self.calls.append(call)
        self._out.deltas.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                 "function": {"name": name, "arguments": ""}})
        return call

    def _send_args(self, call: _Call, args: str) -> None:
        if len(args) <= len(call.sent_args) or not args.startswith(call.sent_args):
            return
        diff, call.sent_args = args[len(call.sent_args):], args
        self._out.deltas.append({"index": self.calls.index(call),
                                 "function": {"arguments": diff}})


def _final_args(scan: CallScanner) -> str | None:
    """A complete block's arguments text, or None when the block is not a call."""
    obj = _loads(scan.text)
    if scan.state != "done" or not isinstance(obj, dict) or not isinstance(obj.get("name"),
                                                                            str):
        return None
    if scan.args_start is None or scan.args_end is None:
        return "{}" if "arguments" not in obj else json.dumps(obj["arguments"],
                                                              ensure_ascii=False)
    if scan.args_kind == '"':
        return obj["arguments"]
    return scan.text[scan.args_start:scan.args_end]


@dataclass(frozen=True)
class ParsedCalls:
    """A whole text's tool calls (OpenAI's ``message.tool_calls``) and content."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_tool_calls(text: str, parallel: bool = True) -> ParsedCalls:
    """The tool calls in a whole ``text``: only blocks that are calls, checked whole."""
    stream = HermesToolStream(parallel=parallel, eager=False)
    out = stream.feed(text)
    out.add(stream.finish())
    calls = [{"id": c.id, "type": "function",
              "function": {"name": c.name, "arguments": c.sent_args}} for c in stream.calls]
    return ParsedCalls(out.content or None, calls)


__all__ = ["CALL_END", "CALL_START", "CallScanner", "HermesToolStream", "ParsedCalls",
           "TOOL_PARSERS", "ToolOutput", "new_call_id", "parse_tool_calls"]
