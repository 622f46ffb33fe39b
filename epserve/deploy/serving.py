"""OpenAIServing: completions, chat, models, tokenize — from a parsed body to a response.

Invariants: every limit is checked before the engine sees the request (model name, prompt
length against the context, token ids in the vocabulary, sampling values via SamplingParams);
a streamed response is SSE chunks ending in ``data: [DONE]`` — an error after the 200 is one
error event before it, never a hung or cut stream; whatever way a response ends, its engine
requests are finished or aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from epserve.deploy import chat_template, tokenize_api
from epserve.deploy import responses as R
from epserve.deploy.chat_output import (
    ChatParsing, ToolPlan, choice_parser, echoed, reply_role, reply_starts_thinking, tool_plan,
)
from epserve.deploy.engine_client import EngineClient
from epserve.deploy.errors import ApiError, bad_request
from epserve.deploy.logprob_fields import chat_logprobs, completion_logprobs
from epserve.deploy.metrics import ServerMetrics
from epserve.deploy.openai_models import (
    ChatCompletionRequest, CompletionRequest, sampling_kwargs, validate,
)
from epserve.deploy.stream import Delta, DeltaTracker, Fanout, Prompt, open_streams
from epserve.deploy.tokenize_api import TokenizeRequest
from epserve.head.limits import RequestLimits
from epserve.head.outputs import RequestOutput

log = logging.getLogger(__name__)

#: Texts longer than this are tokenized on a worker thread, off the event loop.
_THREAD_TOKENIZE_CHARS = 8192


@dataclass(frozen=True)
class ModelInfo:
    """What ``HeadActor.ready()`` reports, as the ingress uses it."""

    name: str
    path: str
    max_model_len: int
    vocab_size: int
    limits: RequestLimits  # the engine's per-request bounds, checked here first
    prefix_caching: bool = True  # the engine reuses computed prompt prefixes


class OpenAIServing:
    def __init__(self, client: EngineClient, tokenizer: Any, info: ModelInfo,
                 metrics: ServerMetrics, parsing: ChatParsing = ChatParsing(),
                 tokens_as_ids: bool = False):
        """``tokens_as_ids``: ``--return-tokens-as-token-ids``, a request's own field aside."""
        self.client = client
        self.tokenizer = tokenizer
        self.info = info
        self.metrics = metrics
        self.parsing = parsing  # the tool-call and reasoning parsers (serve flags)
        self.tokens_as_ids = tokens_as_ids

    # ------------------------------------------------------------------ shared checks

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.info.name:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    def need_tokenizer(self, what: str, param: str) -> Any:
        if self.tokenizer is None:
            raise bad_request(f"{what}: this model folder has no tokenizer; send the prompt as "
                              f"token ids", param=param)
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        tok = self.need_tokenizer("text prompts", param)

        def run() -> list[int]:
            return list(tok.encode(text, add_special_tokens=add_special_tokens))
        return await asyncio.to_thread(run) if len(text) > _THREAD_TOKENIZE_CHARS else run()

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        v = self.info.vocab_size
        for t in ids:
            if not 0 <= t < v:
                raise bad_request(f"{param}: {t} is not a token id in [0, {v})", param=param)

    def _check_context(self, n_prompt: int, max_tokens: int | None, param: str,
                       tokens_param: str = "max_tokens") -> None:
        limit = self.info.max_model_len
        if n_prompt == 0:
            raise bad_request(f"{param} must not be empty", param=param)
        if n_prompt >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, "
                              f"your request has {n_prompt} input tokens. Please reduce the "
                              f"length of the input.", param=param,
                              code="context_length_exceeded")
        if max_tokens is not None and max_tokens > 0 and n_prompt + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, "
                              f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the "
                              f"input, {max_tokens} in the completion). Please reduce the length "
                              f"of the input or completion.", param=tokens_param,
                              code="context_length_exceeded")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False) if self.tokenizer else ""

    def _decode_one(self, tid: int) -> str:
        return self.decode([tid])

    def _truncate(self, p: Prompt, keep: int | None) -> Prompt:
        """``truncate_prompt_tokens``: only the last ``keep`` tokens (-1: the context length);
        a shortened prompt's text is its ids' text."""
        if keep is None:
            return p
        limit = self.info.max_model_len
        if keep > limit:  # vLLM's refusal, word for word
            raise bad_request(f"truncate_prompt_tokens value ({keep}) is greater than "
                              f"max_model_len ({limit}). Please, select a smaller truncation "
                              f"size.", param="truncate_prompt_tokens")
        keep = limit if keep == -1 else keep
        return p if len(p.ids) <= keep else Prompt(None, p.ids[-keep:])

    async def render_chat(self, req: ChatCompletionRequest | TokenizeRequest,
                          continue_final: bool = False,
                          tools: list[dict[str, Any]] | None = None) -> Prompt:
        """The chat template applied to the messages (and tools, and the request's
        ``chat_template_kwargs``), and its token ids."""
        tok = self.need_tokenizer("chat", "messages")
        if not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions",
                              param="messages")
        msgs = [m.to_template(f"messages.{i}") for i, m in enumerate(req.messages or [])]
        text = chat_template.render(tok, msgs, tools=tools,
                                    add_generation_prompt=req.add_generation_prompt,
                                    continue_final=continue_final,
                                    kwargs=req.chat_template_kwargs)
        return Prompt(text, await self.encode(text, bool(req.add_special_tokens), "messages"))

    # ------------------------------------------------------------------ completions

    async def completions(self, body: dict[str, Any]) -> dict[str, Any] | AsyncIterator[str]:
        t0 = time.monotonic()
        req: CompletionRequest = validate(CompletionRequest, body)
        req.check()
        self.check_model(req.model)
        logprobs, prompt_lp = completion_logprobs(req, self.info.vocab_size)
        prompts = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = await self.encode(p, req.add_special_tokens, param="prompt")
                prompts.append(Prompt(p, ids))
            else:
                self.check_ids(p, "prompt")
                prompts.append(Prompt(None, list(p)))
        prompts = [self._truncate(p, req.truncate_prompt_tokens) for p in prompts]
        max_tokens = req.wanted_max_tokens()  # None (an explicit null): to the context length
        for p in prompts:
            self._check_context(len(p.ids), max_tokens, "prompt")
        kw = sampling_kwargs(req, max_tokens=max_tokens, logprobs=logprobs,
                             prompt_logprobs=prompt_lp, limits=self.info.limits)
        head = R.Head.new("cmpl", "text_completion", self.info.name, req.request_id)
        fan = await open_streams(self.client, head.engine_id, prompts, kw, "prompt",
                                 self.metrics, t0)
        if req.stream:
            return self._completion_stream(req, head, prompts, fan)
        try:
            finals = await fan.final()
        finally:
            await fan.close()
        return self._completion_body(req, head, prompts, finals)

    def _echo_logprobs(self, req: CompletionRequest, prompt: Prompt, out: RequestOutput,
                       gen_ids: Sequence[int], gen_lps: Sequence[Any], first: bool,
                       offset: int) -> dict[str, Any] | None:
        if req.logprobs is None:
            return None
        ids, lps = list(gen_ids), list(gen_lps or [])
        if req.echo and first:
            plps = out.prompt_logprobs or [None] * len(prompt.ids)
            ids, lps = prompt.ids + ids, list(plps) + lps
        return R.completion_logprobs(ids, lps, offset, self._decode_one, self._as_ids(req),
                                     req.logprobs)

    def _as_ids(self, req: Any) -> bool:
        """Logprob tokens as ``token_id:N``: the request's field, else the server's flag."""
        own = req.return_tokens_as_token_ids
        return self.tokens_as_ids if own is None else own

    def _prompt_text(self, p: Prompt) -> str:
        return p.text if p.text is not None else self.decode(p.ids)

    def _completion_body(self, req: CompletionRequest, head: R.Head, prompts: list[Prompt],
                         finals: list[RequestOutput]) -> dict[str, Any]:
        choices, n_gen = [], 0
        for i, (p, out) in enumerate(zip(prompts, finals)):
            plps = R.prompt_logprobs_json(out.prompt_logprobs) \
                if req.prompt_logprobs is not None else None
            for c in out.outputs:
                prefix = self._prompt_text(p) if req.echo else ""
                lps = self._echo_logprobs(req, p, out, c.token_ids, c.logprobs or [], True, 0)
                choice = R.completion_choice(i * req.n + c.index, prefix + c.text, lps,
                                             c.finish_reason, c.stop_reason, plps)
                choices.append(R.with_ids(choice, req, c.token_ids, p.ids))
                n_gen += len(c.token_ids)
        n_prompt = sum(len(p.ids) for p in prompts)
        return head.body(choices=choices, usage=R.usage(
            n_prompt, n_gen, sum(out.num_cached_tokens for out in finals)),
            system_fingerprint=None)

    def _completion_stream(self, req: CompletionRequest, head: R.Head,
                           prompts: list[Prompt], fan: Fanout) -> AsyncIterator[str]:
        tracker = DeltaTracker(len(prompts), req.n)
        offsets = [0] * (len(prompts) * req.n)
        extra = {"usage": None} if req.include_usage else {}

        def chunk(i: int, out: RequestOutput, d: Delta) -> dict[str, Any]:
            p = prompts[i]
            text = (self._prompt_text(p) + d.text) if (req.echo and d.first) else d.text
            lps = self._echo_logprobs(req, p, out, d.token_ids, d.logprobs or [], d.first,
                                      offsets[d.index])
            if lps is not None:
                offsets[d.index] = lps["text_offset"][-1] + len(lps["tokens"][-1]) \
                    if lps["tokens"] else offsets[d.index]
            # no prompt_logprobs: refused with stream (logprob_fields), as vLLM refuses them
            choice = R.completion_choice(d.index, text, lps, d.finish_reason, d.stop_reason)
            return head.body(choices=[R.with_ids(choice, req, d.token_ids, p.ids, d.first)],
                             **extra)

        return self._sse(fan, tracker, req, chunk, head, want_lp=req.logprobs is not None)

    async def _sse(self, fan: Fanout, tracker: DeltaTracker, req: Any,
                   chunk: Callable[[int, RequestOutput, Delta], dict[str, Any] | None],
                   head: R.Head,
                   want_lp: bool, opening: Sequence[dict[str, Any]] = ()) -> AsyncIterator[str]:
        """The SSE body: ``opening`` chunks, one chunk per delta, usage, ``[DONE]``."""
        try:
            for c in opening:
                yield R.sse(c)
            async for i, out in fan.outputs():
                for d in tracker.update(i, out, want_lp, req.return_token_ids):
                    c = chunk(i, out, d)
                    if c is None:  # a parser holds the text back (a tag may be starting)
                        continue
                    if req.continuous_usage:
                        c["usage"] = R.usage(sum(tracker.prompt_tokens),
                                             tracker.completion_tokens,
                                             sum(tracker.cached_tokens))
                    yield R.sse(c)
            if req.include_usage:
                yield R.sse(head.body(choices=[], usage=R.usage(
                    sum(tracker.prompt_tokens), tracker.completion_tokens,
                    sum(tracker.cached_tokens))))
        except ApiError as exc:
            yield R.sse(exc.body())
        except Exception:  # a bug here must still end the stream properly
            log.exception("stream failed")
            yield R.sse(ApiError(500, "internal server error", code="internal_error").body())
        finally:
            await fan.close()
        yield R.sse("[DONE]")

    # ------------------------------------------------------------------ chat

    async def chat(self, body: dict[str, Any]) -> dict[str, Any] | AsyncIterator[str]:
        t0 = time.monotonic()
        req: ChatCompletionRequest = validate(ChatCompletionRequest, body)
        req.check()
        self.check_model(req.model)
        logprobs, prompt_lp = chat_logprobs(req, self.info.vocab_size)
        plan = tool_plan(req, self.parsing)
        prompt = await self.render_chat(req, req.continue_final_message, plan.render)
        in_reasoning = reply_starts_thinking(self.parsing, prompt.text, req)
        prompt = self._truncate(prompt, req.truncate_prompt_tokens)
        max_tokens = req.wanted_max_tokens()
        self._check_context(len(prompt.ids), max_tokens, "messages",
                            "max_completion_tokens" if req.max_completion_tokens is not None
                            else "max_tokens")
        kw = sampling_kwargs(req, max_tokens=max_tokens, logprobs=logprobs, limits=self.info.limits,
                             prompt_logprobs=prompt_lp, constraint=plan.constraint)
        if plan.parse:  # as vLLM's hermes parser: tool tags may be special tokens
            kw["skip_special_tokens"] = False
        head = R.Head.new("chatcmpl", "chat.completion", self.info.name, req.request_id)
        fan = await open_streams(self.client, head.engine_id, [prompt], kw, "messages",
                                 self.metrics, t0)
        echo, role = echoed(req), reply_role(req)  # vLLM's
        if req.stream:
            return self._chat_stream(req, head, fan, echo, role, prompt.ids, plan, in_reasoning)
        try:
            (out,) = await fan.final()
        finally:
            await fan.close()
        choices = []
        for c in out.outputs:
            p = choice_parser(self.parsing, plan, in_reasoning, True, req.include_reasoning)
            choice = R.chat_choice(c.index, p.message(c.text, echo, role),
                                   self._chat_lps(req, c.token_ids, c.logprobs),
                                   p.finish_reason(c.finish_reason), c.stop_reason)
            choices.append(R.with_ids(choice, req, c.token_ids, prompt.ids, with_prompt=False))
        body = head.body(choices=choices, usage=R.usage(
            len(prompt.ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens),
            system_fingerprint=None,
            prompt_logprobs=R.prompt_logprobs_json(out.prompt_logprobs)
            if req.prompt_logprobs is not None else None)  # null when not asked for
        if req.return_token_ids:  # a chat response's prompt ids sit at the top, as vLLM's
            body["prompt_token_ids"] = list(prompt.ids)
        return body

    def _chat_lps(self, req: ChatCompletionRequest, ids: Sequence[int], lps: Any) -> dict | None:
        if not req.logprobs:
            return None
        return R.chat_logprobs(ids, lps or [], req.top_logprobs or 0, self._as_ids(req))

    def _chat_stream(self, req: ChatCompletionRequest, head: R.Head, fan: Fanout, echo: str,
                     role: str, prompt_ids: list[int], plan: ToolPlan,
                     in_reasoning: bool) -> AsyncIterator[str]:
        head = R.Head(head.id, "chat.completion.chunk", head.model, head.created)
        extra = {"usage": None} if req.include_usage else {}
        if req.continuous_usage:
            extra = {"usage": R.usage(len(prompt_ids), 0)}
        if req.return_token_ids:  # the prompt's ids once, at the top of the opening chunks
            extra = {**extra, "prompt_token_ids": list(prompt_ids)}
        opening = [head.body(choices=[R.chat_delta(k, {"role": role, "content": ""})],
                             **extra) for k in range(req.n)]
        extra = {"usage": None} if req.include_usage else {}
        tracker = DeltaTracker(1, req.n)
        parsers = [choice_parser(self.parsing, plan, in_reasoning, False, req.include_reasoning)
                   for _ in range(req.n)]

        def chunk(i: int, out: RequestOutput, d: Delta) -> dict[str, Any] | None:
            p = parsers[d.index]
            delta = p.step(d.text, finished=d.finish_reason is not None)
            if d.first and echo:
                delta["content"] = echo + delta.get("content", "")
            if not delta and not d.finish_reason:
                if not (req.logprobs or req.return_token_ids):
                    return None  # held back: nothing decided yet
                delta = {"content": ""}
            lps = self._chat_lps(req, d.token_ids, d.logprobs)
            choice = R.chat_delta(d.index, delta, lps, p.finish_reason(d.finish_reason),
                                  d.stop_reason)
            return head.body(choices=[R.with_ids(choice, req, d.token_ids, prompt_ids, False)],
                             **extra)

        return self._sse(fan, tracker, req, chunk, head, want_lp=bool(req.logprobs),
                         opening=opening)

    # ------------------------------------------------------------------ models, tokenize

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.info.name, "object": "model", "created": 0, "owned_by": "epserve",
            "root": self.info.path, "parent": None, "max_model_len": self.info.max_model_len}]}

    async def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        return await tokenize_api.tokenize(self, body)

    async def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        return await tokenize_api.detokenize(self, body)
