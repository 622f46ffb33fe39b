"""OpenAI's Responses API request body (POST /v1/responses) as pydantic models, and its
translation into the OpenAI chat body the chat path serves.

Invariants: values are coerced as vLLM's (and the chat models') are; an unknown field is a 400 naming it, as the chat
models do. ``input`` is a string or a list of items, each kept in order: ``message`` items (a
``developer`` message is a system message, as OpenAI defines it), ``function_call`` items and
``function_call_output`` items (the tool loop), and ``reasoning`` items sent back; a model
turn sent back (its reasoning, message and calls, consecutive items) becomes one assistant
chat message. Anything the server cannot honour is a 400 naming it, never dropped: a
non-text content part, an item of another type, stored state (``previous_response_id``,
``store`` true, ``background``, ``conversation``), an invalid ``text.format`` (json_object
and json_schema become chat's ``response_format``: structured output), ``reasoning.summary``, and ``reasoning.effort`` unless a reasoning parser
is on and the chat template reads ``reasoning_effort`` (the chat path checks that).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from epserve.deploy.errors import ApiError, bad_request
from epserve.deploy.openai_models import INT32, validate
from epserve.deploy.structured_output import responses_text_format

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)  # vLLM's coercions
_TEXT_ONLY = "this server serves text-only models; send input_text parts"
_NOT_STORED = ("this server does not store responses, so it cannot refer to earlier ones; "
               "send the whole conversation as input")
#: Item types the server knows but cannot serve, and why.
_UNSUPPORTED_ITEMS = {"item_reference": _NOT_STORED, "compaction": _NOT_STORED}
_BUILTIN_TOOLS = "built-in tools are not supported by this server; only function tools"


class FunctionTool(BaseModel):
    """A tool in the Responses shape (flat: no ``function`` wrapper)."""

    model_config = _STRICT
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: the chat path enforces it for a forced tool_choice only

    def to_chat(self) -> dict[str, Any]:
        fn = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": fn}

    def echo(self) -> dict[str, Any]:
        """As the response reports it (strict: what was served, never enforced here)."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": bool(self.strict)}


class NamedFunction(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class Reasoning(BaseModel):
    model_config = _STRICT
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: dict[str, Any] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = _STRICT
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = Field(None, max_length=1024)
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    store: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping input) is not served
    # stored state: declared so the refusal says why (see check)
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None

    def check(self, reasoning_parser: str | None) -> None:
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise bad_request(f"{name}: {_NOT_STORED}", param=name)
        if self.store:
            raise bad_request("store: this server does not store responses (there is no GET "
                              "/v1/responses/{id}); send store false or leave it out",
                              param="store")
        if self.background:
            raise bad_request("background: background responses need storage, which this "
                              "server does not have", param="background")
        if self.text is not None and self.text.format is not None:
            responses_text_format(self.text.format)  # a 400 naming text.format when invalid
        r = self.reasoning
        if r is not None and (r.summary or r.generate_summary):
            raise bad_request("reasoning.summary: this server does not summarize reasoning; "
                              "the reasoning comes back whole as reasoning items",
                              param="reasoning")
        if r is not None and r.effort is not None and not reasoning_parser:
            raise bad_request("reasoning.effort: this server runs without a reasoning parser "
                              "(--reasoning-parser), so it serves no reasoning to set an effort "
                              "for", param="reasoning")

    def function_tools(self) -> list[FunctionTool]:
        out = []
        for k, t in enumerate(self.tools or []):
            if t.get("type") != "function":
                raise bad_request(f"tools.{k}.type: {t.get('type')!r}: {_BUILTIN_TOOLS}",
                                  param="tools")
            out.append(_item(FunctionTool, t, f"tools.{k}", "tools"))
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """The chat body's ``tool_choice`` (the chat path refuses what it cannot serve)."""
        c = self.tool_choice
        if c is None or isinstance(c, str):
            return c
        if c.get("type") != "function":
            raise bad_request(f"tool_choice: {c.get('type')!r} is not supported; only 'auto', "
                              f"'none', 'required' or a function", param="tool_choice")
        named = _item(NamedFunction, c, "tool_choice", "tool_choice")
        return {"type": "function", "function": {"name": named.name}}

    def chat_body(self) -> dict[str, Any]:
        """The OpenAI chat body that asks the engine for this response."""
        tools = self.function_tools()
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(),
                                "stream": self.stream, "user": self.user}
        optional = {"max_completion_tokens": self.max_output_tokens,
                    "temperature": self.temperature, "top_p": self.top_p,
                    "tools": [t.to_chat() for t in tools] or None,
                    "tool_choice": self.chat_tool_choice(),
                    "parallel_tool_calls": self.parallel_tool_calls}
        body.update({k: v for k, v in optional.items() if v is not None})
        fmt = responses_text_format(self.text.format) \
            if self.text is not None and self.text.format is not None else None
        if fmt is not None:
            body["response_format"] = fmt
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        if self.stream:  # usage in every chunk: input tokens at the start, output at the end
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body

    def chat_messages(self) -> list[dict[str, Any]]:
        """``instructions`` and ``input`` as chat messages, in order."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        if not self.input:
            raise bad_request("input must not be empty", param="input")
        turn: dict[str, Any] | None = None  # the assistant turn being sent back
        for i, raw in enumerate(self.input):
            msg = _input_item(raw, f"input.{i}")
            if msg["role"] != "assistant":
                turn = None
                out.append(msg)
            elif turn is not None and _joins(turn, msg):
                _merge(turn, msg)
            else:
                turn = msg
                out.append(turn)
        return out


# ---------------------------------------------------------------------- input items


class _Part(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[None] | None = Field(None, max_length=0)  # a reply's, sent back
    logprobs: list[Any] | None = None


class _Item(BaseModel):
    """An input item; ``id`` and ``status`` are a reply's, sent back (read by no one)."""

    model_config = _STRICT
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[dict[str, Any]]]
    phase: None = None


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[dict[str, Any]]]


class _ReasoningText(BaseModel):
    model_config = _STRICT
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[None] = Field(default_factory=list, max_length=0)  # none made here
    content: list[_ReasoningText] | None = None
    encrypted_content: None = None


def _item(model: type[BaseModel], raw: Any, where: str, param: str) -> Any:
    """``model`` from one item, or a 400 naming its place and field."""
    if not isinstance(raw, dict):
        raise bad_request(f"{where}: expected an object", param=param)
    try:
        return validate(model, raw)
    except ApiError as exc:
        raise bad_request(f"{where}.{exc.message}", param=param) from None


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A content's text: a string, or text parts joined (any other part is a 400)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in ("input_text", "output_text"):
            raise bad_request(f"{where}.{j}.type: {kind!r} content parts are not supported "
                              f"({_TEXT_ONLY})", param="input")
        texts.append(_item(_Part, raw, f"{where}.{j}", "input").text)
    return "\n".join(texts)


def _input_item(raw: Any, where: str) -> dict[str, Any]:
    """One input item as a chat message (a ``role`` without a ``type`` is a message)."""
    kind = raw.get("type", "message" if "role" in raw else None) \
        if isinstance(raw, dict) else None
    if kind == "message":
        m: MessageItem = _item(MessageItem, raw, where, "input")
        role = "system" if m.role == "developer" else m.role
        return {"role": role, "content": _text(m.content, f"{where}.content")}
    if kind == "function_call":
        c: FunctionCallItem = _item(FunctionCallItem, raw, where, "input")
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}]}
    if kind == "function_call_output":
        o: FunctionCallOutputItem = _item(FunctionCallOutputItem, raw, where, "input")
        return {"role": "tool", "tool_call_id": o.call_id,
                "content": _text(o.output, f"{where}.output")}
    if kind == "reasoning":
        r: ReasoningItem = _item(ReasoningItem, raw, where, "input")
        return {"role": "assistant", "content": None,
                "reasoning_content": "".join(p.text for p in r.content or [])}
    why = _UNSUPPORTED_ITEMS.get(kind, _BUILTIN_TOOLS) if isinstance(kind, str) else \
        "an item needs a type (or a role, for a message)"
    raise bad_request(f"{where}.type: {kind!r} input items are not supported ({why})",
                      param="input")


def _joins(turn: dict[str, Any], msg: dict[str, Any]) -> bool:
    """Whether ``msg`` (an assistant-side item) continues ``turn``: reasoning comes first,
    then the text, then the calls."""
    if "reasoning_content" in msg:
        return not turn.get("content") and not turn.get("tool_calls") \
            and "reasoning_content" not in turn
    if msg.get("tool_calls"):
        return True
    return not turn.get("content") and not turn.get("tool_calls")


def _merge(turn: dict[str, Any], msg: dict[str, Any]) -> None:
    if msg.get("tool_calls"):
        turn["tool_calls"] = turn.get("tool_calls", []) + msg["tool_calls"]
    elif "reasoning_content" in msg:
        turn["reasoning_content"] = msg["reasoning_content"]
    else:
        turn["content"] = msg["content"]


def parse(body: dict[str, Any], reasoning_parser: str | None) -> ResponsesRequest:
    """The request from a parsed body, checked; a 400 naming the first bad field."""
    req: ResponsesRequest = validate(ResponsesRequest, body)
    req.check(reasoning_parser)
    return req
