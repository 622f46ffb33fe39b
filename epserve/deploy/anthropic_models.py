"""Anthropic's Messages API request bodies (POST /v1/messages and /v1/messages/count_tokens)
as pydantic models, and their translation into the OpenAI chat body the chat path serves.

Invariants: models are strict and refuse an unknown field with a 400 naming it, as the OpenAI
models do; every content block the server cannot honour (``image``, ``document``, ``tool_use``,
``tool_result``, ``thinking``, ...) is a 400 naming its place and type, never dropped; the
translation keeps every message and text block, in order: ``system`` becomes the first chat
message, text blocks stay text parts (the chat path joins them), and a final ``assistant``
message is continued (Anthropic's prefill: the answer carries on from it) rather than
answered. ``cache_control`` (``ephemeral``) is accepted because the engine's prefix cache keeps
every prompt prefix it has computed (on by default); ``usage.cache_read_input_tokens`` reports
what it reused.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from epserve.deploy.errors import ApiError, bad_request
from epserve.deploy.openai_models import INT32, validate

_STRICT = ConfigDict(strict=True, extra="forbid")

#: Why each Anthropic block type but text cannot be served here.
_TEXT_ONLY = "this server serves text-only models"
_NO_TOOLS = "tool use is not supported by this server yet"
_NO_THINKING = "extended thinking is not supported by this server"
_UNSUPPORTED_BLOCKS = {
    "image": _TEXT_ONLY, "document": _TEXT_ONLY, "container_upload": _TEXT_ONLY,
    "search_result": "search results are not supported by this server",
    "tool_use": _NO_TOOLS, "tool_result": _NO_TOOLS, "server_tool_use": _NO_TOOLS,
    "web_search_tool_result": _NO_TOOLS,
    "thinking": _NO_THINKING, "redacted_thinking": _NO_THINKING,
}


class CacheControl(BaseModel):
    """A prompt-cache breakpoint. The engine's prefix cache is automatic: every prefix it has
    computed is kept while memory allows, breakpoint or not."""

    model_config = _STRICT
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # a response block sent back; only empty is served

    def check(self, where: str) -> None:
        if self.citations:
            raise bad_request(f"{where}.citations: citations are not supported by this server",
                              param=where.split(".", 1)[0])


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]

    def to_chat(self, index: int) -> dict[str, Any]:
        """The message as an OpenAI chat message: a string, or its text blocks as text parts."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        parts = [_text_block(b, f"messages.{index}.content.{j}")
                 for j, b in enumerate(self.content)]
        return {"role": self.role, "content": [{"type": "text", "text": t} for t in parts]}


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
    # Anthropic's fields this server refuses (see check); declared so the refusal says why.
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def check(self) -> None:
        if not self.messages:
            raise bad_request("messages: at least one message is required", param="messages")
        if self.tools:
            raise bad_request(f"tools: {_NO_TOOLS}", param="tools")
        choice = (self.tool_choice or {}).get("type")
        if self.tool_choice is not None and choice not in ("auto", "none"):
            raise bad_request(f"tool_choice: {choice!r} needs tools, which this server does "
                              f"not support yet; only 'auto' and 'none' are accepted",
                              param="tool_choice")
        if self.thinking is not None:
            raise bad_request(f"thinking: {_NO_THINKING}", param="thinking")

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
        out += [m.to_chat(i) for i, m in enumerate(self.messages)]
        return out

    def template_fields(self) -> dict[str, Any]:
        """The chat body's messages and how the template ends them."""
        return {"model": self.model, "messages": self.chat_messages(),
                "add_generation_prompt": not self.prefill,
                "continue_final_message": self.prefill}


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
        body = {**self.template_fields(), "max_tokens": self.max_tokens,
                "stream": self.stream, "stop": self.stop_sequences,
                "user": self.metadata.user_id if self.metadata else None}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stream:  # usage in every chunk: input tokens at the start, output at the end
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body


def _text_block(block: dict[str, Any], where: str) -> str:
    """A content block's text, or a 400 naming the block (its place and type)."""
    kind = block.get("type")
    if kind != "text":
        why = _UNSUPPORTED_BLOCKS.get(kind) if isinstance(kind, str) else None
        what = f"{kind!r} content blocks are not supported ({why})" if why else \
            f"{kind!r} is not a content block type this server knows"
        raise bad_request(f"{where}.type: {what}; send text blocks", param="messages")
    try:
        tb: TextBlock = validate(TextBlock, block)
    except ApiError as exc:  # put the block's place in front of the field it names
        raise bad_request(f"{where}.{exc.message}", param="messages") from None
    tb.check(where)
    return tb.text


def parse(model: type[CountTokensRequest], body: dict[str, Any]) -> Any:
    """``model`` from a parsed body, checked; a 400 naming the first bad field."""
    req = validate(model, body)
    req.check()
    return req
