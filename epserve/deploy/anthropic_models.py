"""Anthropic's Messages API request bodies (POST /v1/messages and /v1/messages/count_tokens)
as pydantic models, and their translation into the OpenAI chat body the chat path serves.

Invariants: models are strict and refuse an unknown field with a 400 naming it, as the OpenAI
models do; every content block the server cannot honour (``image``, ``document``,
``redacted_thinking``, server tools, ...) is a 400 naming its place and type, never dropped;
the translation keeps every message and block, in order (``anthropic_blocks``: text, tool use
and results, thinking): ``system`` becomes the first chat message, text blocks stay text parts
(the chat path joins them), and a final ``assistant`` message is continued (Anthropic's
prefill: the answer carries on from it) rather than answered. ``tools``, ``tool_choice`` and
``thinking`` become the chat body's ``tools``, ``tool_choice`` / ``parallel_tool_calls`` and
``chat_template_kwargs.enable_thinking``, so the chat path's checks (the server's flags, what
the template reads) judge them. ``cache_control`` (``ephemeral``) is accepted because the
engine's prefix cache keeps every prompt prefix it has computed (on by default);
``usage.cache_read_input_tokens`` reports what it reused. On a server without the prefix cache
it would do nothing, so there it is a 400 (``check_cache_control``).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from epserve.deploy.anthropic_blocks import (
    CacheControl, TextBlock, Thinking, ToolChoice, assistant_message, parse_tools,
    user_messages,
)
from epserve.deploy.errors import bad_request
from epserve.deploy.openai_models import INT32, validate

_STRICT = ConfigDict(strict=True, extra="forbid")


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]

    def to_chat(self, index: int, final: bool, asked: set[str]) -> tuple[list[dict[str, Any]],
                                                                         set[str]]:
        """The message as OpenAI chat messages (a user message's tool results are ``tool``
        messages of their own), and the tool_use ids it asks (``asked``: the previous
        assistant message's, which its tool results answer)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}], set()
        if self.role == "user":
            return user_messages(self.content, index, asked), set()
        msg, ids = assistant_message(self.content, index, final)
        return [msg], ids


class Metadata(BaseModel):
    """Anthropic's request metadata: an opaque id of the end user, for the caller's records."""

    model_config = _STRICT
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: what shapes the prompt."""

    model_config = _STRICT
    model: str
    messages: list[Message] = Field(..., max_length=4096)
    system: Union[str, list[TextBlock], None] = None
    cache_control: CacheControl | None = None
    tools: list[Any] | None = Field(None, max_length=1024)  # each parsed by parse_tools
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def check(self) -> None:
        if not self.messages:
            raise bad_request("messages: at least one message is required", param="messages")
        if self.tool_choice is not None:
            self.tool_choice.check()
        if self.thinking is not None:
            self.thinking.check(getattr(self, "max_tokens", None))

    @property
    def prefill(self) -> bool:
        """The last message is the assistant's: the answer continues it."""
        return self.messages[-1].role == "assistant"

    def chat_messages(self) -> list[dict[str, Any]]:
        """``system`` and ``messages`` as OpenAI chat messages, in order."""
        out = []
        if isinstance(self.system, str):
            out.append({"role": "system", "content": self.system})
        elif self.system is not None:
            for j, block in enumerate(self.system):
                block.check(f"system.{j}")
            out.append({"role": "system",
                        "content": [{"type": "text", "text": b.text} for b in self.system]})
        asked: set[str] = set()
        last = len(self.messages) - 1
        for i, m in enumerate(self.messages):
            msgs, asked = m.to_chat(i, final=i == last and self.prefill, asked=asked)
            out += msgs
        return out

    def template_fields(self) -> dict[str, Any]:
        """The chat body's messages, tools and template switches, and how the template ends
        the messages."""
        out: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(),
                               "add_generation_prompt": not self.prefill,
                               "continue_final_message": self.prefill}
        if self.tools:
            out["tools"] = [t.to_chat() for t in parse_tools(self.tools)]
        if self.thinking is not None:
            out["chat_template_kwargs"] = self.thinking.template_kwargs()
        return out


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(..., ge=1, le=INT32)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = Field(None, ge=0, le=INT32)
    metadata: Metadata | None = None
    stream: bool = False

    def chat_body(self) -> dict[str, Any]:
        """The OpenAI chat body that asks the engine for this message."""
        body = {**self.template_fields(), **self.tool_fields(), "max_tokens": self.max_tokens,
                "stream": self.stream, "stop": self.stop_sequences,
                "user": self.metadata.user_id if self.metadata else None}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stream:  # usage in every chunk: input tokens at the start, output at the end
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body

    def tool_fields(self) -> dict[str, Any]:
        """``tool_choice`` as the chat body's fields (with no tools, ``auto`` and ``none``
        both mean no call: the chat path's default then)."""
        choice = self.tool_choice
        if choice is None or (not self.tools and choice.type in ("auto", "none")):
            return {}
        return choice.to_chat()


def _has_cache_control(value: Any) -> bool:
    if isinstance(value, dict):
        return "cache_control" in value or any(_has_cache_control(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_cache_control(v) for v in value)
    return False


def check_cache_control(body: dict[str, Any], prefix_caching: bool) -> None:
    """``cache_control`` anywhere in ``body`` is a 400 on a server whose engine keeps no
    prompt prefixes (--no-prefix-caching): it could not be honoured."""
    if not prefix_caching and _has_cache_control(body):
        raise bad_request("cache_control: this server runs without the prefix cache "
                          "(--no-prefix-caching), so no prompt prefix is cached",
                          param="cache_control")


def parse(model: type[CountTokensRequest], body: dict[str, Any]) -> Any:
    """``model`` from a parsed body, checked; a 400 naming the first bad field."""
    req = validate(model, body)
    req.check()
    return req
