"""A request's logprob fields at the HTTP edge, as vLLM's server reads them: what the engine is
asked for (``-1``: the whole vocabulary) and vLLM's refusals, word for word.

Invariants: ``prompt_logprobs`` (both routes) and chat's ``top_logprobs`` take ``-1`` as the
vocabulary size; a completion's ``logprobs`` does not (a 400, as vLLM's request model refuses
it), and no other negative value passes. What is asked for, ``-1`` resolved, is bound by the
engine's ``--max-logprobs`` (itself ``-1``: the vocabulary) with vLLM's refusal naming the
number asked and the bound, so ``-1`` is served exactly where the server allows the whole
vocabulary. ``prompt_logprobs`` with ``stream`` is a 400 on both routes (vLLM's words): no
stream chunk carries them. vLLM lets ``prompt_logprobs: 0`` through with ``stream`` and drops
it; here it is refused too, since nothing is accepted and ignored. Every refusal's ``param`` is
the field the client sent (chat's bound: ``logprobs``, as vLLM's).
"""

from __future__ import annotations

from typing import Any

from epserve.deploy.errors import bad_request

#: vLLM's value for "every token of the vocabulary"
WHOLE_VOCABULARY = -1
STREAMED_PROMPT_LOGPROBS = "`prompt_logprobs` are not available when `stream=True`."


def _at_least_zero(name: str, value: int | None, whole_vocabulary_ok: bool) -> None:
    if value is None or value >= 0 or (whole_vocabulary_ok and value == WHOLE_VOCABULARY):
        return
    either = " or -1" if whole_vocabulary_ok else ""
    raise bad_request(f"`{name}` must be a positive value{either}.", param=name)


def _resolved(value: int | None, vocab_size: int) -> int | None:
    return vocab_size if value == WHOLE_VOCABULARY else value


def _prompt_logprobs(req: Any, vocab_size: int) -> int | None:
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request(STREAMED_PROMPT_LOGPROBS, param="prompt_logprobs")
    _at_least_zero("prompt_logprobs", req.prompt_logprobs, True)
    return _resolved(req.prompt_logprobs, vocab_size)


def completion_logprobs(req: Any, vocab_size: int) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) a completion request asks the engine for: an echoed prompt
    with ``logprobs`` needs the prompt's too, as many (or ``prompt_logprobs``' own, if more)."""
    prompt = _prompt_logprobs(req, vocab_size)
    _at_least_zero("logprobs", req.logprobs, False)
    if req.echo and req.logprobs is not None:
        prompt = max(prompt or 0, req.logprobs)
    return req.logprobs, prompt


def chat_logprobs(req: Any, vocab_size: int) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) a chat request asks the engine for; its ``top_logprobs``
    is set to the number it stands for (``-1``: the vocabulary size), which the answer's
    ``top_logprobs`` lists then hold."""
    prompt = _prompt_logprobs(req, vocab_size)
    top = req.top_logprobs
    _at_least_zero("top_logprobs", top, True)
    if top and not req.logprobs:  # 0 without logprobs passes, as in vLLM
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.",
                          param="top_logprobs")
    req.top_logprobs = _resolved(top, vocab_size)
    return ((req.top_logprobs or 0) if req.logprobs else None), prompt


def check_bound(kw: dict[str, Any], max_logprobs: int) -> None:
    """vLLM's refusal, word for word (clients match it), of more logprobs than
    ``--max-logprobs`` (resolved); ``kw``: the SamplingParams keywords."""
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        v = kw.get(name)
        if type(v) is int and v > max_logprobs:
            raise bad_request(f"Requested {kind} logprobs of {v}, which is greater than max "
                              f"allowed: {max_logprobs}", param=name)


__all__ = ["STREAMED_PROMPT_LOGPROBS", "WHOLE_VOCABULARY", "chat_logprobs", "check_bound",
           "completion_logprobs"]
