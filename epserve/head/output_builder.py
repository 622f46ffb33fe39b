"""Turns a head ``Request`` into the vLLM-shaped ``RequestOutput`` a user reads.

Invariants: outputs are cumulative (text and tokens so far); a running output's text stops
before anything that could still become a stop string; logprobs appear only when asked for,
one dict per generated token holding the sampled token and its top-k alternatives. Each
token's dict is built once and kept (streaming stays linear in the output length).
"""

from __future__ import annotations

from typing import Any

from epserve.head.outputs import CompletionOutput, LogprobsDict, RequestOutput, make_logprobs_dict
from epserve.head.sequence import Request, Sequence


def _decoder(tokenizer: Any):
    return lambda tid: tokenizer.decode([tid], skip_special_tokens=False)


def prompt_logprobs(req: Request, tokenizer: Any) -> list[LogprobsDict | None] | None:
    """vLLM's shape: ``None`` for the first prompt token, then one dict per position."""
    if req.params.prompt_logprobs is None or req.prompt_logprobs is None:
        return None
    dec = _decoder(tokenizer)
    return [None] + [make_logprobs_dict(e.token_id, e.logprob, e.top, dec, e.rank)
                     for e in req.prompt_logprobs]


def _sampled_logprobs(seq: Sequence, tokenizer: Any) -> list[LogprobsDict]:
    cache: list[LogprobsDict] = seq.logprob_dicts
    dec = _decoder(tokenizer)
    for t in seq.sampled[len(cache):]:
        cache.append(make_logprobs_dict(t.token_id, t.logprob, t.top, dec, t.rank))
    return list(cache)


def _completion(seq: Sequence, tokenizer: Any) -> CompletionOutput:
    text = seq.text if seq.finished else seq.text[:seq.stops.safe_stream_len(seq.text)]
    want_lp = seq.request.params.logprobs is not None
    return CompletionOutput(
        index=seq.index,
        text=text,
        token_ids=list(seq.output_ids),
        cumulative_logprob=sum(t.logprob for t in seq.sampled) if want_lp else None,
        logprobs=_sampled_logprobs(seq, tokenizer) if want_lp else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )


def build_output(req: Request, tokenizer: Any) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=list(req.prompt_ids),
        prompt_logprobs=prompt_logprobs(req, tokenizer),
        outputs=[_completion(s, tokenizer) for s in req.seqs],
        finished=req.finished,
        error=req.error,
        num_cached_tokens=req.num_cached_tokens,
    )
