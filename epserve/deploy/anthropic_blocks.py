"""Anthropic's content blocks, tools, ``tool_choice`` and ``thinking`` as the chat path's
messages and fields (``anthropic_models`` builds the chat body from them).

Invariants:
- ``messages`` keep their order and every block: a user message's ``tool_result`` blocks
  become ``tool`` messages (in place: text blocks around them stay user messages), an
  assistant message's ``tool_use`` blocks its ``tool_calls`` (``input`` as the arguments'
  JSON) and its ``thinking`` blocks its ``reasoning_content`` (rendered where the template
  renders reasoning; a template that never reads it refuses them, see ``anthropic_api``). A
  ``tool_result`` with ``is_error: true`` is rendered as its text behind ``"Error: "`` (chat
  templates have no error field), and must answer a ``tool_use`` of the assistant message
  just before it. A block that cannot be served is a 400 naming its place and type.
- tool ids: the chat path's ``chatcmpl-tool-X`` goes out as ``toolu_X``, and ``toolu_X``
  comes back as ``chatcmpl-tool-X`` (any other id is kept as it is), so a ``tool_result`` and
  the ``tool_use`` it answers carry the same id in the chat history, as a chat client's would.
- ``tool_choice``: ``auto`` / ``none`` are the chat path's; ``any`` is its ``required`` and
  ``{"type": "tool", "name"}`` its named function (both forced with structured output, no serve
  flags needed); ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
- ``thinking``: ``enabled`` / ``disabled`` is the template's ``enable_thinking``; a
  ``budget_tokens`` is honoured only when it cannot bind (at least ``max_tokens``), and refused
  otherwise: nothing stops a thinking block early.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from epserve.deploy.errors import ApiError, bad_request
from epserve.deploy.openai_models import INT32, validate

_STRICT = ConfigDict(strict=True, extra="forbid")
#: The chat path's tool call ids (``tool_parser.new_call_id``) and Anthropic's, before the hex.
_CHAT_ID, _ANTHROPIC_ID = "chatcmpl-tool-", "toolu_"

_TEXT_ONLY = "this server serves text-only models"
_SERVER_TOOLS = "server tools are not supported by this server"
#: Why a block type cannot be served, or in which role it belongs.
_UNSUPPORTED_BLOCKS = {
    "image": _TEXT_ONLY, "document": _TEXT_ONLY, "container_upload": _TEXT_ONLY,
    "search_result": "search results are not supported by this server",
    "server_tool_use": _SERVER_TOOLS, "web_search_tool_result": _SERVER_TOOLS,
    "redacted_thinking": "this server never redacts thinking and cannot render it",
    "tool_use": "only assistant messages carry tool_use blocks",
    "thinking": "only assistant messages carry thinking blocks",
    "tool_result": "only user messages carry tool_result blocks",
}
_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}


def to_anthropic_id(chat_id: str) -> str:
    """A chat tool call's id as a ``tool_use`` block's."""
    return _ANTHROPIC_ID + chat_id.removeprefix(_CHAT_ID)


def to_chat_id(tool_use_id: str) -> str:
    """A ``tool_use`` id (or a ``tool_result``'s ``tool_use_id``) as the chat history's."""
    if tool_use_id.startswith(_ANTHROPIC_ID):
        return _CHAT_ID + tool_use_id[len(_ANTHROPIC_ID):]
    return tool_use_id


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


class ToolUseBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[dict[str, Any]] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(BaseModel):
    model_config = _STRICT
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # this server signs nothing (it sends ""): any is taken


_BLOCK_MODELS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
                 "thinking": ThinkingBlock}


def parse_block(block: Any, where: str, role: str = "user") -> Any:
    """A content block of a ``role``'s message, parsed, or a 400 naming it (place and type)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in _BLOCKS.get(role, ("text",)):
        why = _UNSUPPORTED_BLOCKS.get(kind) if isinstance(kind, str) else None
        what = f"{kind!r} content blocks are not supported here ({why})" if why else \
            f"{kind!r} is not a content block type this server knows"
        raise bad_request(f"{where}.type: {what}; a {role} message takes "
                          f"{' and '.join(_BLOCKS.get(role, ('text',)))} blocks",
                          param="messages")
    try:
        parsed = validate(_BLOCK_MODELS[kind], block)
    except ApiError as exc:  # put the block's place in front of the field it names
        raise bad_request(f"{where}.{exc.message}", param="messages") from None
    if isinstance(parsed, TextBlock):
        parsed.check(where)
    return parsed


def _result_text(block: ToolResultBlock, where: str) -> str:
    """A tool result's content as the ``tool`` message's text (``is_error``: behind
    ``"Error: "``)."""
    content = block.content
    if not isinstance(content, str):
        content = "\n".join(parse_block(b, f"{where}.content.{k}", "tool_result").text
                            for k, b in enumerate(content))
    return f"Error: {content}" if block.is_error else content


def user_messages(blocks: list[Any], index: int, asked: set[str]) -> list[dict[str, Any]]:
    """A user message's blocks as chat messages: each ``tool_result`` a ``tool`` message (it
    must answer one of the ``asked`` tool_use ids), each run of text blocks a user message."""
    out: list[dict[str, Any]] = []
    for j, raw in enumerate(blocks):
        where = f"messages.{index}.content.{j}"
        block = parse_block(raw, where, "user")
        if isinstance(block, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"].append({"type": "text", "text": block.text})
            else:
                out.append({"role": "user", "content": [{"type": "text", "text": block.text}]})
            continue
        if block.tool_use_id not in asked:
            raise bad_request(f"{where}.tool_use_id: {block.tool_use_id!r} answers no tool_use "
                              f"block of the assistant message before it", param="messages")
        out.append({"role": "tool", "tool_call_id": to_chat_id(block.tool_use_id),
                    "content": _result_text(block, where)})
    return out


def assistant_message(blocks: list[Any], index: int, final: bool) -> tuple[dict[str, Any],
                                                                            set[str]]:
    """An assistant message's blocks as one chat message (text, tool calls, reasoning), and
    the ids of its tool_use blocks. A ``final`` one (prefill: continued) takes text only."""
    texts, calls, thoughts, ids = [], [], [], set()
    for j, raw in enumerate(blocks):
        where = f"messages.{index}.content.{j}"
        block = parse_block(raw, where, "assistant")
        if final and not isinstance(block, TextBlock):
            raise bad_request(f"{where}.type: a final assistant message is continued "
                              f"(prefill), which takes text blocks only, not {block.type!r}",
                              param="messages")
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        else:
            ids.add(block.id)
            calls.append({"id": to_chat_id(block.id), "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
    msg: dict[str, Any] = {"role": "assistant", "content": texts}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    return msg, ids


class Tool(BaseModel):
    """A custom tool, as the chat path's function tool."""

    model_config = _STRICT
    type: Literal["custom"] | None = None
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None

    def to_chat(self) -> dict[str, Any]:
        fn = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


def parse_tools(tools: list[Any]) -> list[Tool]:
    """``tools``, each a custom tool (a server tool, with a ``type`` of its own, is a 400)."""
    out = []
    for k, raw in enumerate(tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in (None, "custom"):
            raise bad_request(f"tools.{k}.type: {kind!r}: {_SERVER_TOOLS}; send custom tools "
                              f"(name, description, input_schema)", param="tools")
        try:
            out.append(validate(Tool, raw))
        except ApiError as exc:
            raise bad_request(f"tools.{k}.{exc.message}", param="tools") from None
    return out


class ToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def check(self) -> None:
        if (self.type == "tool") != (self.name is not None):
            raise bad_request("tool_choice.name: a name is given with type 'tool', and only "
                              "then", param="tool_choice")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise bad_request("tool_choice.disable_parallel_tool_use: not with type 'none'",
                              param="tool_choice")

    def to_chat(self) -> dict[str, Any]:
        """The chat body's ``tool_choice`` and ``parallel_tool_calls``."""
        choice: Any = {"auto": "auto", "none": "none", "any": "required"}.get(self.type)
        if self.type == "tool":
            choice = {"type": "function", "function": {"name": self.name}}
        out: dict[str, Any] = {"tool_choice": choice}
        if self.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
        return out


class Thinking(BaseModel):
    model_config = _STRICT
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, le=INT32)

    def check(self, max_tokens: int | None) -> None:
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise bad_request("thinking.budget_tokens: required with type 'enabled', and only "
                              "then", param="thinking")
        if max_tokens is not None and self.budget_tokens is not None and \
                self.budget_tokens < max_tokens:
            raise bad_request(f"thinking.budget_tokens: this server cannot end thinking "
                              f"early, so a budget ({self.budget_tokens}) below max_tokens "
                              f"({max_tokens}) cannot be honoured; send budget_tokens >= "
                              f"max_tokens (the whole answer is the bound)", param="thinking")

    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": self.type == "enabled"}


__all__ = ["CacheControl", "TextBlock", "Thinking", "Tool", "ToolChoice", "assistant_message",
           "parse_block", "parse_tools", "to_anthropic_id", "to_chat_id", "user_messages"]
