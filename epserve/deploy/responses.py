"""OpenAI response bodies and stream chunks, built from engine outputs as plain JSON dicts.

Invariants: field names and nesting are OpenAI's (plus vLLM's ``stop_reason`` and
``prompt_logprobs``); every float is finite (a -inf logprob is written as -9999.0, as vLLM
does), so every body is valid JSON; ``finish_reason`` is "stop", "length" or "tool_calls"
(None while running).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Sequence

from epserve.head.outputs import Logprob, LogprobsDict

_MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False,
                                                       separators=(",", ":"))
    return f"data: {data}\n\n"


def _lp(x: float) -> float:
    return max(float(x), _MIN_LOGPROB)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV came
    from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class Head:
    """What every body of one response repeats: id, object kind, creation time, model."""

    id: str
    object: str
    model: str
    created: int
    engine_id: str = ""  # the base of its engine requests' ids

    @classmethod
    def new(cls, prefix: str, object: str, model: str,
            request_id: str | None = None) -> "Head":
        """``request_id``: the client's (vLLM's field): the id is ``<prefix>-<request_id>``, as
        vLLM's, and the engine's ids add a random suffix (as vLLM's internal ids do), so two
        requests sent with one id never clash."""
        if request_id is None:
            rid = new_id(prefix)
            return cls(rid, object, model, int(time.time()), rid)
        rid = f"{prefix}-{request_id}"
        return cls(rid, object, model, int(time.time()), f"{rid}-{uuid.uuid4().hex[:8]}")

    def body(self, **fields: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, **fields}


# ---------------------------------------------------------------------- logprobs


def _token_text(tid: int, lp: Logprob | None, as_ids: bool = False) -> str:
    """A logprob entry's token string; ``as_ids`` (vLLM's ``return_tokens_as_token_ids``):
    ``token_id:<id>`` whatever it decodes to."""
    if as_ids or lp is None or lp.decoded_token is None:
        return f"token_id:{tid}"
    return lp.decoded_token


def _chosen(position: LogprobsDict, token_id: int, as_ids: bool) -> tuple[str, float]:
    lp = position.get(token_id)
    if lp is None:  # cannot happen for engine outputs; keep the body valid anyway
        return f"token_id:{token_id}", _MIN_LOGPROB
    return _token_text(token_id, lp, as_ids), _lp(lp.logprob)


def completion_logprobs(token_ids: Sequence[int], positions: Sequence[LogprobsDict | None],
                        offset: int, decode: Callable[[int], str] | None = None,
                        as_ids: bool = False, top_n: int | None = None) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for these tokens; ``offset`` is the text
    offset of the first one. A None position (the prompt's first token) has no logprob; its
    text comes from ``decode``. ``top_logprobs`` holds a position's dict in its order (vLLM's:
    the token itself first, then the top k; k + 1 entries when it is not among them), at most
    ``top_n`` + 1 entries (vLLM's cap: an echoed prompt's dicts may hold more, for
    ``prompt_logprobs``)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, positions):
        offsets.append(offset)
        if pos is None:
            text = decode(tid) if decode is not None and not as_ids else f"token_id:{tid}"
            lp, top = None, None
        else:
            text, lp = _chosen(pos, tid, as_ids)
            items = pos.items() if top_n is None else islice(pos.items(), top_n + 1)
            top = {_token_text(t, p, as_ids): _lp(p.logprob) for t, p in items}
        tokens.append(text)
        token_lps.append(lp)
        tops.append(top)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _chat_entry(text: str, lp: float) -> dict[str, Any]:
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[LogprobsDict],
                  top_n: int, as_ids: bool = False) -> dict[str, Any]:
    """The chat ``logprobs`` object: per token, its logprob and ``top_logprobs``: the first
    ``top_n`` entries of the position's dict, as vLLM's: the sampled token first, then the most
    likely others (so ``top_n - 1`` of them when the sampled token is not among the top)."""
    content = []
    for tid, pos in zip(token_ids, positions):
        text, lp = _chosen(pos, tid, as_ids)
        top = [_chat_entry(_token_text(t, p, as_ids), _lp(p.logprob))
               for t, p in list(pos.items())[:top_n]]
        content.append({**_chat_entry(text, lp), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(positions: Sequence[LogprobsDict | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position None or {token_id: {logprob, rank,
    decoded_token}}."""
    if positions is None:
        return None
    return [None if pos is None else {
        str(tid): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for tid, lp in pos.items()} for pos in positions]


# ---------------------------------------------------------------------- choices


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None, prompt_logprobs: list | None = None
                      ) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason,
            "prompt_logprobs": prompt_logprobs}  # null when not asked for, as vLLM's


def chat_choice(index: int, message: dict[str, Any], logprobs: dict | None,
                finish_reason: str | None, stop_reason: int | str | None) -> dict[str, Any]:
    """``message``: role, content, refusal, tool_calls and the reasoning (``chat_output``)."""
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_delta(index: int, delta: dict[str, Any], logprobs: dict | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None
               ) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def with_ids(choice: dict[str, Any], req: Any, token_ids: Sequence[int],
             prompt_ids: Sequence[int], with_prompt: bool = True) -> dict[str, Any]:
    """vLLM's ``return_token_ids``: the choice's (new) token ids, and the prompt's once."""
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
        if with_prompt:
            choice["prompt_token_ids"] = list(prompt_ids)
    return choice
