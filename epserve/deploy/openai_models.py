"""The OpenAI request bodies as pydantic models (the HTTP edge), and their sampling knobs.

Invariants: values are coerced as vLLM's request models (pydantic's lax mode) coerce them
(``"5"`` or ``5.0`` for an int, ``"0.5"`` for a float, ``"true"`` for a bool), never to a NaN or
an infinity; an unknown field is a 400 naming it (vLLM ignores it: nothing a client sends is
accepted and ignored here); every integer is bounded so no value reaches a tensor it cannot
fit; ``sampling_kwargs`` returns plain ``SamplingParams`` keywords that have been checked by
constructing ``SamplingParams`` (its ``ValueError`` becomes a 400 naming the field). The
per-request work limits (``n``, stop strings, stop ids, logprobs: ``head/limits.py``) are the
engine's, configured there and checked by it before the request is queued; its ``ValueError``
reaches the client as the same 400 naming the field, so the edge keeps no copy of them.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from epserve.deploy.chat_content import check_content
from epserve.deploy.errors import bad_request, from_value_error
from epserve.deploy.logprob_fields import check_bound
from epserve.deploy.structured_output import ResponseFormat, StructuredOutputs, structured_fields
from epserve.head.limits import RequestLimits
from epserve.head.sampling_params import SamplingParams

#: Bounds beyond SamplingParams's own and the engine's: prompts per request, choices over
#: several prompts (prompts x n), int32/int64.
MAX_PROMPTS = 256
MAX_CHOICES = 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's, when a completion request leaves the field out
INT32 = 2**31 - 1
# vLLM's coercions (lax), no NaN or infinity; an unknown field is a 400 naming it.
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)

TokenIds = list[int]
_TOKEN_KEY = re.compile(r"\s*[-+]?\d{1,19}\s*")  # what int() reads, bounded


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields both endpoints share (vLLM's names and defaults)."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, le=INT32)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-INT32, le=INT32)
    min_p: float | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int = Field(1, le=INT32)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, le=INT32)
    prompt_logprobs: int | None = Field(None, le=INT32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    echo: bool = False
    return_token_ids: bool = False
    use_beam_search: bool = False
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32)
    # vLLM's penalties (ranges checked by SamplingParams: a 400 naming the field)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # token id (a JSON key: a string) -> bias, clamped to [-100, 100] (SamplingParams)
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's field (deploy.structured_output)
    # vLLM's: the response id is "<cmpl|chatcmpl>-<request_id>" (the engine's ids add a random
    # suffix, so two requests sharing one never clash); priority: only vLLM's default 0
    request_id: str | None = Field(None, max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")
    priority: int = Field(0, ge=-(2**63), lt=2**63)

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true",
                              param="stream_options")
        if self.use_beam_search:
            raise bad_request("beam search is not supported by this server",
                              param="use_beam_search")
        if self.truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be -1 (the context length) or at "
                              "least 1", param="truncate_prompt_tokens")
        if self.stop_token_ids and any(t > INT32 for t in self.stop_token_ids):
            raise bad_request("stop_token_ids must hold token ids", param="stop_token_ids")
        if self.priority != 0:  # vLLM's refusal under its default first-come-first-served
            raise bad_request(f"Got priority {self.priority} but Priority scheduling is not "
                              f"enabled.", param="priority")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's ``continuous_usage_stats``, with ``include_usage``)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    logprobs: int | None = Field(None, le=INT32)
    suffix: str | None = None
    best_of: int | None = Field(None, le=INT32)
    # vLLM's: structured output on completions too, as chat's (deploy.structured_output)
    response_format: ResponseFormat | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt's BOS and the like

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of texts or token-id lists (one per choice group)."""
        p = self.prompt
        if isinstance(p, str):
            out: list[Any] = [p]
        elif not p:
            raise bad_request("prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            out = [p]
        else:
            out = list(p)
        # one prompt's n is the engine's to bound (max_n); this bounds the fan-out of several
        if len(out) > MAX_PROMPTS or (len(out) > 1 and len(out) * self.n > MAX_CHOICES):
            raise bad_request(f"at most {MAX_PROMPTS} prompts and {MAX_CHOICES} choices "
                              f"(prompts x n) per request", param="prompt")
        return out

    def check(self) -> None:
        self.check_common()
        if self.suffix is not None:
            raise bad_request("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", param="best_of")

    def wanted_max_tokens(self) -> int | None:
        """vLLM's: 16 when the field is left out; an explicit null (None) runs to the context
        length (max_model_len less the prompt)."""
        if self.max_tokens is None and "max_tokens" not in self.model_fields_set:
            return COMPLETIONS_DEFAULT_MAX_TOKENS
        return self.max_tokens


class ContentPart(BaseModel):
    """A text part (``chat_content``: any other part is refused before it gets here)."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """An assistant message's earlier tool call, in the history."""

    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message. ``role``: OpenAI's, or any other name the model's chat template knows (as
    vLLM accepts custom roles); the template decides what it means. An assistant message may
    carry its ``tool_calls`` and its reasoning, a tool message the ``tool_call_id`` it answers
    (what the openai client sends back when a reply is appended to the history)."""

    model_config = _STRICT
    role: str = Field(..., pattern=r"^[A-Za-z][\w-]{0,63}$")
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=1024)
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name of reasoning_content
    # a reply's other fields, sent back with it (``message.model_dump()``): when empty only
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[None] | None = Field(None, max_length=0)

    # what is wrong with a content (an image part, a missing text), not pydantic's union noise
    content_check = field_validator("content", mode="before")(check_content)

    def to_template(self, where: str = "messages") -> dict[str, Any]:
        """The message as a chat template reads it: text parts joined into one string, tool
        call arguments as the JSON value (Qwen's and Llama's templates ``tojson`` them)."""
        content = self.content
        if isinstance(content, list):  # text parts only (chat_content)
            content = "\n".join(part.text for part in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            if self.role != "assistant":
                raise bad_request(f"{where}.tool_calls: only assistant messages carry tool calls",
                                  param="messages")
            msg["tool_calls"] = [_call_to_template(c, f"{where}.tool_calls.{k}")
                                 for k, c in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None:
            msg["reasoning_content"] = msg["reasoning"] = thought
        return msg


def _call_to_template(call: ToolCall, where: str) -> dict[str, Any]:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        raise bad_request(f"{where}.function.arguments: not valid JSON: "
                          f"{call.function.arguments[:80]!r}", param="messages") from None
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": args}}


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef

    def to_template(self) -> dict[str, Any]:
        """As the chat template reads it: OpenAI's shape, unset fields left out."""
        return self.model_dump(exclude_none=True)


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice, None]


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., max_length=4096)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, le=INT32)
    max_completion_tokens: int | None = Field(None, le=INT32)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = Field(None, max_length=1024)
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    include_reasoning: bool = True  # vLLM's: false leaves reasoning out of the answer
    add_special_tokens: bool = False  # vLLM's: the template already wrote them

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both "
                              "be true", param="continue_final_message")

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """``model`` from a parsed body, or a 400 naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = [str(p) for p in err.get("loc", ())]
        where = ".".join(loc) or "body"
        msg = "this server does not support this field" if err.get("type") == "extra_forbidden" \
            else str(err.get("msg", "invalid value"))
        raise bad_request(f"{where}: {msg}", param=loc[0] if loc else None) from None


def sampling_kwargs(req: _SamplingRequest, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None, limits: RequestLimits,
                    constraint: dict[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams keywords for ``req`` (checked: a bad value, or one over the engine's
    ``limits``, is a 400 naming it, before this side allocates anything per choice).
    ``constraint``: the structured output the server puts on the output (a forced
    ``tool_choice``'s) in place of the request's own, which it must not have."""
    kw: dict[str, Any] = dict(
        n=req.n, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        v = getattr(req, name)
        if v is not None:
            kw[name] = v
    if isinstance(kw["stop"], list):
        kw["stop"] = list(kw["stop"])
    check_bound(kw, limits.max_logprobs)
    if req.logit_bias:
        kw["logit_bias"] = _bias_by_id(req.logit_bias)
    # a 400 naming the field when invalid
    structured = constraint if constraint is not None else structured_fields(req)
    if structured is not None:
        kw["structured_outputs"] = structured
    try:
        limits.check(SamplingParams(**kw))
    except ValueError as exc:
        raise from_value_error(exc) from None
    return kw


def _bias_by_id(bias: dict[str, float]) -> dict[int, float]:
    """``logit_bias`` with its keys as token ids (vLLM's: a key must read as an integer)."""
    out = {}
    for key, value in bias.items():
        if not _TOKEN_KEY.fullmatch(key):
            raise bad_request(f"logit_bias: found token id {key[:40]!r}, but a token id must "
                              f"be an integer or a string representing one", param="logit_bias")
        out[int(key)] = value
    return out


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "NamedToolChoice", "Tool",
           "sampling_kwargs", "validate"]
