"""vLLM's /tokenize and /detokenize over ``OpenAIServing``: a text prompt or a conversation (the
chat template applied as generation applies it) to token ids, and ids back to text.

Invariants: exactly one of ``prompt`` and ``messages``; the chat-only fields
(``add_generation_prompt``, ``continue_final_message``, ``tools``, ``chat_template_kwargs``)
shape a conversation's rendering, so sent with a ``prompt`` (never rendered) each is a 400
naming it rather than accepted and ignored (vLLM ignores them); ``add_special_tokens`` defaults
as vLLM's (true for a prompt, false for messages); a conversation's ids are the ones chat
generation would be given; ids outside the vocabulary are a 400 naming ``tokens``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from epserve.deploy.errors import bad_request
from epserve.deploy.openai_models import _STRICT, ChatMessage, Tool, validate

#: what only a conversation's rendering reads
CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs")


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt or a conversation."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=4096)
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = Field(None, max_length=1024)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _special_tokens_default(self) -> "TokenizeRequest":
        if self.add_special_tokens is None:
            self.add_special_tokens = self.messages is None
        return self

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send exactly one of prompt and messages", param="prompt")
        if self.messages is None:
            for name in CHAT_ONLY:
                if name in self.model_fields_set and getattr(self, name) is not None:
                    raise bad_request(f"{name} applies to messages (the chat template), and a "
                                      f"prompt is tokenized as it is; leave it out or send "
                                      f"messages", param=name)
            return
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                              "true", param="continue_final_message")


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


async def tokenize(serving: Any, body: dict[str, Any]) -> dict[str, Any]:
    """/tokenize's answer (``serving``: ``OpenAIServing``)."""
    req: TokenizeRequest = validate(TokenizeRequest, body)
    serving.check_model(req.model)
    req.check()
    if req.messages is not None:
        tools = [t.to_template() for t in req.tools or []] or None
        ids = (await serving.render_chat(req, req.continue_final_message, tools)).ids
    else:
        ids = await serving.encode(req.prompt or "", req.add_special_tokens, "prompt")
    strs = None
    if req.return_token_strs:
        strs = list(serving.need_tokenizer("tokenize", "prompt").convert_ids_to_tokens(ids))
    return {"count": len(ids), "max_model_len": serving.info.max_model_len, "tokens": ids,
            "token_strs": strs}


async def detokenize(serving: Any, body: dict[str, Any]) -> dict[str, Any]:
    """/detokenize's answer (``serving``: ``OpenAIServing``)."""
    req: DetokenizeRequest = validate(DetokenizeRequest, body)
    serving.check_model(req.model)
    serving.need_tokenizer("detokenize", "tokens")
    serving.check_ids(req.tokens, "tokens")
    try:
        return {"prompt": serving.decode(req.tokens)}
    except Exception as exc:  # ids the model has but its tokenizer does not
        raise bad_request(f"tokens: cannot decode them: {exc}", param="tokens") from None


__all__ = ["CHAT_ONLY", "DetokenizeRequest", "TokenizeRequest", "detokenize", "tokenize"]
