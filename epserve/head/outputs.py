"""vLLM-shaped request outputs: ``Logprob``, ``CompletionOutput``, ``RequestOutput``.

Invariants: outputs are plain mutable dataclasses the engine fills in step by step; a
``CompletionOutput`` is finished exactly when its ``finish_reason`` is set; logprob dicts map
token id to ``Logprob``: the chosen token first, then the top alternatives ranked 1.. (vLLM's
order); the chosen token outside them has its real rank.
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

#: Why a completion ended (vLLM's values).
FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's logprob; ``rank`` 1 is the most likely (vLLM's: the tokens at least as
    likely, itself included; None: not known); ``decoded_token`` the token's own text (None
    when not decoded)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One position's logprobs: the chosen (or prompt) token and its alternatives.
LogprobsDict = dict[int, Logprob]


def make_logprobs_dict(
    token_id: int,
    logprob: float,
    top: Sequence[tuple[int, float]],
    decode: Callable[[int], str] | None = None,
    rank: int | None = None,
) -> LogprobsDict:
    """A position's dict from a chosen token and its ``top`` alternatives (highest first).

    vLLM's order: the chosen (sampled or prompt) token first, then the alternatives ranked
    1..k (the chosen one appears once, first, with its rank in the top when it is among them,
    as vLLM's dict keeps it; else k + 1 entries). Outside the top its rank is ``rank``, the
    one its rank computed (None when not known). ``decode`` fills ``decoded_token``.
    """
    rank = next((r for r, (tid, _) in enumerate(top, start=1) if tid == token_id), rank)
    out: LogprobsDict = {token_id: Logprob(logprob, rank, decode(token_id) if decode else None)}
    for r, (tid, lp) in enumerate(top, start=1):
        if tid != token_id:
            out[tid] = Logprob(lp, r, decode(tid) if decode else None)
    return out


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's ``n`` completions, as far as it has been generated.

    ``text``: detokenised output (stop string cut per the request); ``token_ids``: every
    generated id; ``cumulative_logprob``: sum of the chosen tokens' logprobs (None when
    logprobs were not requested); ``logprobs``: one dict per generated token, or None;
    ``stop_reason``: the stop token id or stop string that ended it (None for EOS, length).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsDict] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={_logprobs_summary(self.logprobs)}, "
                f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})")


@dataclass(slots=True)
class RequestOutput:
    """One request's state: its prompt, per-position prompt logprobs (first entry None, as in
    vLLM: the first token has no context), the completions, and whether all are finished.
    ``error``: set when the request failed (its completions then end with "error").
    ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[LogprobsDict | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"prompt_logprobs={_logprobs_summary(self.prompt_logprobs)}, "
                f"outputs={self.outputs!r}, finished={self.finished}, error={self.error!r})")


def _logprobs_summary(lps: list | None) -> str:
    # Full logprob dicts swamp a repr (k alternatives per token); the count says enough.
    return "None" if lps is None else f"<{len(lps)} positions>"
