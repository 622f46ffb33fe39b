"""A chat choice's text as vLLM's server returns it: reasoning (``--reasoning-parser``) and tool
calls (``--enable-auto-tool-choice --tool-call-parser``) separated from the content, whole or
as stream deltas; and what a request's ``tools`` / ``tool_choice`` ask of the server.

Invariants: the reasoning is split off first, and tool calls are parsed in the content after
it; a streamed choice's deltas add up to its whole message (the same reasoning, content, tool
names and arguments); ``finish_reason`` is ``tool_calls`` once a choice made a call (``auto``)
and when a ``required`` choice stopped, ``stop`` for a named function, as vLLM gives them;
reasoning goes out under both of vLLM's names, ``reasoning_content`` and ``reasoning``, unless
the request's ``include_reasoning`` is false (then neither, whole or streamed; still split off).
``tool_choice`` ``required`` or a named function is forced with structured output
(``forced_tools``), needs no serve flags, and is parsed by its own stream (never the hermes
parser, never a reasoning split: the constraint holds from the first token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epserve.deploy.errors import bad_request
from epserve.deploy.forced_tools import ForcedChoice, ForcedToolStream, forced_choice
from epserve.deploy.openai_models import ChatCompletionRequest
from epserve.deploy.reasoning_parser import (
    REASONING_PARSERS, ReasoningSplitter, starts_in_reasoning,
)
from epserve.deploy.tool_parser import TOOL_PARSERS, HermesToolStream, ToolOutput

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')


@dataclass(frozen=True)
class ChatParsing:
    """The server's parsers (its ``serve`` flags)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {list(TOOL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice (--enable-auto-tool-choice) needs "
                             "tool_call_parser (--tool-call-parser) to be set")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tool fields ask for: the tools to render (None: none), whether
    the output is parsed for calls (``auto``), whether more than one call is kept, and the
    forced choice (``required`` or a named function; its constraint on the output)."""

    render: list[dict[str, Any]] | None
    parse: bool
    parallel: bool
    forced: ForcedChoice | None = None

    @property
    def constraint(self) -> dict[str, Any] | None:
        """The structured output a forced choice puts on the output (None: none)."""
        return self.forced.constraint if self.forced is not None else None


def tool_plan(req: ChatCompletionRequest, parsing: ChatParsing) -> ToolPlan:
    """The request's tool fields checked against the server's flags, as vLLM checks them."""
    choice = req.tool_choice
    tools = [t.to_template() for t in req.tools or []] or None
    if choice is None:  # vLLM's default: auto with tools, none without
        choice = "auto" if req.tools else "none"
    if choice != "none" and req.tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    parallel = req.parallel_tool_calls is not False
    forced = forced_choice(req, choice, parallel)  # no serve flags needed, as in vLLM
    for k, t in enumerate(req.tools or []):
        if t.function.strict and forced is None:
            raise bad_request(f"tools.{k}.function.strict: a strict schema is enforced only "
                              f"when tool_choice is 'required' or names a function (the call "
                              f"is then constrained by structured output)", param="tools")
    if forced is not None:
        return ToolPlan(tools, False, parallel, forced)
    parse = choice == "auto" and bool(req.tools)
    if parse and not (parsing.enable_auto_tool_choice and parsing.tool_call_parser):
        raise bad_request(AUTO_NEEDS_FLAGS, param="tool_choice")
    return ToolPlan(tools, parse, parallel)


@dataclass
class Piece:
    """What a choice's text gave so far: reasoning, content and tool-call deltas."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] | None = None

    def add(self, other: "Piece") -> "Piece":
        calls = (self.calls or []) + (other.calls or [])
        return Piece(self.reasoning + other.reasoning, self.content + other.content, calls)

    def delta(self) -> dict[str, Any]:
        """As a stream chunk's ``delta`` (empty when nothing was decided)."""
        d: dict[str, Any] = {}
        if self.reasoning:
            d["reasoning_content"] = d["reasoning"] = self.reasoning
        if self.content:
            d["content"] = self.content
        if self.calls:
            d["tool_calls"] = merged_calls(self.calls)
        return d


def merged_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One chunk's tool-call deltas with one entry per ``index`` (as OpenAI and vLLM send
    them): a call's opening entry (id, type, name) and its argument pieces become one entry
    whose ``arguments`` are the pieces joined, in order of first appearance."""
    by_index: dict[int, dict[str, Any]] = {}
    for d in deltas:
        seen = by_index.get(d["index"])
        if seen is None:
            by_index[d["index"]] = {**d, "function": dict(d["function"])}
        else:
            fn = seen["function"]
            fn["arguments"] = fn.get("arguments", "") + d["function"].get("arguments", "")
    return list(by_index.values())


class ChoiceParser:
    """One choice's parsers: its reasoning split (or None) and its tool-call stream (or
    None)."""

    def __init__(self, reasoning: ReasoningSplitter | None,
                 tools: HermesToolStream | ForcedToolStream | None,
                 forced: ForcedChoice | None = None, keep_reasoning: bool = True):
        self.reasoning, self.tools, self.forced = reasoning, tools, forced
        self.keep_reasoning = keep_reasoning  # vLLM's include_reasoning: false drops it

    @property
    def made_calls(self) -> bool:
        return bool(self.tools and self.tools.calls)

    def feed(self, text: str) -> Piece:
        return self._pass(*(self.reasoning.feed(text) if self.reasoning else ("", text)),
                          end=False)

    def finish(self) -> Piece:
        return self._pass(*(self.reasoning.finish() if self.reasoning else ("", "")), end=True)

    def _pass(self, reasoning: str, content: str, end: bool) -> Piece:
        reasoning = reasoning if self.keep_reasoning else ""
        if self.tools is None:
            return Piece(reasoning, content)
        out: ToolOutput = self.tools.feed(content)
        if end:
            out.add(self.tools.finish())
        return Piece(reasoning, out.content, out.deltas)

    def step(self, text: str, finished: bool) -> dict[str, Any]:
        """A stream chunk's ``delta`` for the choice's new ``text`` (and its end, when
        ``finished``): empty while everything is held back."""
        piece = self.feed(text)
        return (piece.add(self.finish()) if finished else piece).delta()

    def message(self, text: str, prefix: str = "", role: str = "assistant") -> dict[str, Any]:
        """A whole text as the choice's ``message`` (``prefix``: echoed before the content;
        ``role``: ``reply_role``'s)."""
        a, b = self.feed(text), self.finish()
        content = prefix + a.content + b.content
        calls = []
        if self.tools is not None:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.name, "arguments": c.sent_args}}
                     for c in self.tools.calls]
        thought = (a.reasoning + b.reasoning) or None
        parsed = self.reasoning is not None or self.tools is not None
        if self.forced is not None:  # vLLM's: the calls, and an empty content
            content, parsed = content or "", False
        return {"role": role, "content": (content or None) if parsed else content,
                "refusal": None, "tool_calls": calls, "reasoning_content": thought,
                "reasoning": thought}

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's: ``tool_calls`` once an ``auto`` choice made a call, or when a ``required``
        one stopped (its grammar complete); a named function's stays ``stop``."""
        if self.forced is not None:
            required = self.forced.name is None
            return "tool_calls" if required and reason == "stop" and self.made_calls else reason
        return "tool_calls" if reason is not None and self.made_calls else reason


def reply_role(req: ChatCompletionRequest) -> str:
    """vLLM's: the reply is the assistant's after a generation prompt; without one it goes on
    in the last message's role."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


def echoed(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's content, when it is in the reply's role
    (``reply_role``), goes before the reply's content; else nothing."""
    last = req.messages[-1]
    if req.echo and last.role == reply_role(req):
        return last.to_template()["content"]
    return ""


def reply_starts_thinking(parsing: ChatParsing, prompt_text: str | None,
                          req: ChatCompletionRequest) -> bool:
    """Whether the reply to this rendered prompt starts inside the thinking block (its
    template opened it, or the continued final assistant message did)."""
    if not parsing.reasoning_parser:
        return False
    last = req.messages[-1]
    final = last.to_template()["content"] if (req.continue_final_message and
                                              last.role == "assistant") else None
    return starts_in_reasoning(parsing.reasoning_parser, prompt_text, final)


def choice_parser(parsing: ChatParsing, plan: ToolPlan, in_reasoning: bool,
                  whole: bool, keep_reasoning: bool = True) -> ChoiceParser:
    """A fresh parser for one choice (``whole``: the text comes at once, so a tool-call block
    counts only once it is known to be a call; ``keep_reasoning``: vLLM's
    ``include_reasoning``, false leaves the split-off reasoning out of message and deltas)."""
    if plan.forced is not None:  # all of the output is the call(s): no reasoning, no tags
        return ChoiceParser(None, ForcedToolStream(plan.forced.name, plan.parallel),
                            plan.forced)
    reasoning = ReasoningSplitter(in_reasoning) if parsing.reasoning_parser else None
    tools = HermesToolStream(plan.parallel, eager=not whole) if plan.parse else None
    return ChoiceParser(reasoning, tools, keep_reasoning=keep_reasoning)


__all__ = ["AUTO_NEEDS_FLAGS", "ChatParsing", "ChoiceParser", "Piece", "ToolPlan",
           "choice_parser", "echoed", "merged_calls", "reply_role", "reply_starts_thinking",
           "tool_plan"]
