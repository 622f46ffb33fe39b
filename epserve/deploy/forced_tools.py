"""``tool_choice`` ``required`` and a named function, forced with structured output as vLLM
serves them: the output is constrained so that it always parses and names a real tool.

- a named function (``{"type": "function", "function": {"name": N}}``): the output is held to
  that tool's ``parameters`` JSON schema (an object without properties when it has none), and
  the whole text is that one call's arguments;
- ``required``: the output is a JSON array of ``{"name": <one of the tools>, "parameters":
  <that tool's schema>}`` objects (``anyOf`` over the tools; at least one, and at most one with
  ``parallel_tool_calls: false``), each a call whose arguments are its ``parameters``. The
  tools' ``$defs`` / ``definitions`` are gathered at the array schema's root, where their
  ``$ref``s point.

Invariants: a forced choice needs no serve flags (vLLM asks ``--enable-auto-tool-choice`` for
``auto`` only); its constraint is checked here, before anything is queued, by the one
definition of a valid constraint (``StructuredOutputsParams``): a tool schema that cannot be
one is a 400 naming the tool; it holds from the first token (``enable_in_reasoning``), a
reasoning model's thinking block included. A named function not among ``tools``, ``required`` with no
tools, two tools defining one ``$defs`` name differently, or a forced choice together with
the request's own ``response_format`` / ``structured_outputs`` (each is a constraint on the
whole output) is a 400 that names them. ``ForcedToolStream`` sends a call's id, type and name
first, then its arguments as the text arrives (the text as the model wrote it); fed whole, it
gives the same calls.

An output cut short (``max_tokens``: ``finish_reason`` ``length``, streamed or not) keeps what
it got, one shape for both: the calls as far as they go (the last one's arguments cut, not
valid JSON; vLLM's named choice does the same, its ``required`` fails the whole response with
a JSON parse error), and the text of a ``required`` array element cut before its call's name
was complete (all of it when no call opened) as ``content``, so no generated text is dropped.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from epserve.deploy.errors import bad_request
from epserve.deploy.tool_parser import CallScanner, ToolOutput, _Call, new_call_id
from epserve.head.structured_params import StructuredOutputsParams

_DEF_KEYS = ("$defs", "definitions")
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ForcedChoice:
    """A forced ``tool_choice``: the named function (None for ``required``) and the
    constraint on the output (``StructuredOutputsParams`` fields, as they travel)."""

    name: str | None
    constraint: dict[str, Any]


def _describe(choice: Any) -> str:
    return "'required'" if choice == "required" else \
        f"naming the function {choice.function.name!r}"


def _own_constraint(req: Any) -> str | None:
    """The request's own structured-output field, when it set one."""
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        return f"response_format (type {fmt.type!r})"
    if getattr(req, "structured_outputs", None) is not None:
        return "structured_outputs"
    return None


def forced_choice(req: Any, choice: Any, parallel: bool) -> ForcedChoice | None:
    """The forced choice of a chat request whose ``tool_choice`` is ``choice`` (already
    defaulted), None for ``auto`` and ``none``; a 400 for what cannot be served."""
    if isinstance(choice, str) and choice != "required":
        return None
    tools = req.tools or []
    own = _own_constraint(req)
    if own is not None:
        raise bad_request(f"tool_choice {_describe(choice)} and {own} cannot be combined: a "
                          f"forced tool call constrains the whole output to the call "
                          f"(structured output of its own); send one of them",
                          param="tool_choice")
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice 'required' needs at least one tool in tools",
                              param="tools")
        return ForcedChoice(None, _whole_output(_checked_calls(tools, parallel)))
    name = choice.function.name
    for k, tool in enumerate(tools):
        if tool.function.name == name:
            return ForcedChoice(name, _whole_output(
                _checked(_parameters(tool), f"tools.{k}.function.parameters")))
    names = ", ".join(repr(t.function.name) for t in tools) or "none"
    raise bad_request(f"tool_choice names the function {name!r}, which is not among tools "
                      f"(they are: {names})", param="tool_choice")


def _whole_output(constraint: dict[str, Any]) -> dict[str, Any]:
    """The constraint on the whole output, a reasoning model's thinking block included (the
    call is all the output; an engine with a reasoning parser would else hold it back until
    ``</think>``)."""
    return {**constraint, "enable_in_reasoning": True}


def _parameters(tool: Any) -> dict[str, Any]:
    """A copy of the tool's parameters schema (the request's own is left as it came)."""
    params = tool.function.parameters
    return copy.deepcopy(params) if params else dict(_NO_PARAMETERS)


def _checked(schema: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"json": schema}`` when xgrammar takes ``schema``, else a 400 naming ``where``."""
    try:
        StructuredOutputsParams(json=schema)
    except ValueError as exc:
        msg = str(exc).replace("SamplingParams.structured_outputs.json", where)
        raise bad_request(msg, param="tools") from None
    return {"json": schema}


def calls_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """``required``'s schema: an array of calls, each one of the tools with its arguments."""
    defs: dict[str, dict[str, Any]] = {key: {} for key in _DEF_KEYS}
    alternatives = []
    for k, tool in enumerate(tools):
        params = _parameters(tool)
        for key in _DEF_KEYS:
            own = params.pop(key, None) if isinstance(params, dict) else None
            for def_name, definition in (own or {}).items():
                if defs[key].get(def_name, definition) != definition:
                    raise bad_request(f"tools.{k}.function.parameters.{key}.{def_name}: "
                                      f"another tool defines {def_name!r} differently; with "
                                      f"tool_choice 'required' the tools' definitions share "
                                      f"one schema", param="tools")
                defs[key][def_name] = definition
        alternatives.append({"properties": {
            "name": {"type": "string", "enum": [tool.function.name]},
            "parameters": params}, "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({key: d for key, d in defs.items() if d})
    return schema


def _checked_calls(tools: list[Any], parallel: bool) -> dict[str, Any]:
    schema = calls_schema(tools, parallel)
    try:
        StructuredOutputsParams(json=schema)
    except ValueError:
        for k, tool in enumerate(tools):  # the tool whose schema it is, when one alone fails
            _checked(_parameters(tool), f"tools.{k}.function.parameters")
        return _checked(schema, "tools (every tool's schema, as tool_choice 'required' "
                                "joins them)")
    return {"json": schema}


class ForcedToolStream:
    """One choice's forced output, fed in pieces, as tool calls: ``HermesToolStream``'s
    interface (``feed`` / ``finish`` give ``ToolOutput``s of call deltas; ``calls``)."""

    def __init__(self, name: str | None, parallel: bool = True):
        self.name, self.parallel = name, parallel
        self.calls: list[_Call] = []
        self._out = ToolOutput()
        self._scan: CallScanner | None = None  # the array element being read (required)
        self._call: _Call | None = None        # its call, once its name is read
        self._before = ""  # required: the text so far while no call has opened

    def feed(self, text: str) -> ToolOutput:
        if text and self.name is not None:
            self._named(text)
        elif text:
            self._array(text)
        return self._take()

    def finish(self) -> ToolOutput:
        """The end of the text: a call cut short (``max_tokens``) keeps what it got; the text
        of an element cut before its call opened (all the text, when none did) is content."""
        if self._scan is not None:
            self._update()
            if self._call is None and self.calls:
                self._out.content += self._scan.text
            self._scan = self._call = None
        if not self.calls:
            self._out.content += self._before
        self._before = ""
        return self._take()

    def _take(self) -> ToolOutput:
        out, self._out = self._out, ToolOutput()
        return out

    def _named(self, text: str) -> None:
        if not self.calls:  # the first text opens the call: id and name with it
            call = _Call(new_call_id(), self.name or "", text)
            self.calls.append(call)
            self._out.deltas.append({"index": 0, "id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": text}})
            return
        self.calls[0].sent_args += text
        self._out.deltas.append({"index": 0, "function": {"arguments": text}})

    def _array(self, text: str) -> None:
        if not self.calls:
            self._before += text
        for c in text:
            if self._scan is None:
                if c != "{":  # "[", "]", "," and the whitespace between the calls
                    continue
                self._scan, self._call = CallScanner(args_key="parameters"), None
            self._scan.feed(c)
            if self._scan.state in ("done", "bad"):
                self._update()
                self._scan = self._call = None
        if self._scan is not None:
            self._update()

    def _update(self) -> None:
        """Send what the open element gave since the last update: the call's start once its
        name is read, then its arguments as far as they go."""
        scan = self._scan
        assert scan is not None
        if self._call is None and scan.name is not None and (self.parallel or not self.calls):
            self._call = _Call(new_call_id(), scan.name)
            self.calls.append(self._call)
            self._out.deltas.append({"index": len(self.calls) - 1, "id": self._call.id,
                                     "type": "function",
                                     "function": {"name": scan.name, "arguments": ""}})
        call = self._call
        if call is None or scan.args_start is None:
            return
        end = scan.args_end if scan.args_end is not None else len(scan.text)
        args = scan.text[scan.args_start:end]
        if len(args) > len(call.sent_args) and args.startswith(call.sent_args):
            diff, call.sent_args = args[len(call.sent_args):], args
            self._out.deltas.append({"index": self.calls.index(call),
                                     "function": {"arguments": diff}})


__all__ = ["ForcedChoice", "ForcedToolStream", "calls_schema", "forced_choice"]
