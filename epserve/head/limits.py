"""RequestLimits: the most work one request may ask of the engine, checked before it is queued.

Owns the configurable per-request bounds (engine options ``max_n``, ``max_stop_strings``,
``max_stop_chars``, ``max_stop_token_ids``, ``max_logit_bias``, ``max_logprobs``); prompt and
output length are bounded by ``max_model_len`` elsewhere. Invariants: a request that passes
``check`` costs the engine thread O(n * new text) per step and its stop automaton
O(max_stop_chars) once, so one client cannot slow the others by more than its share; its
banned ids and bias pairs (each shipped to the ranks with its sequence) are bounded by
``max_stop_token_ids`` and ``max_logit_bias``; ``check`` raises ``ValueError`` whose message
starts ``SamplingParams.<field>`` (the HTTP edge answers 400 with ``param`` = field).
``max_logprobs`` here is resolved (``-1``, the vocabulary, is the engine options' spelling:
``models.sampling_rules.resolve_max_logprobs``). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from epserve.head.sampling_params import SamplingParams
from epserve.models.sampling_rules import MAX_LOGPROBS


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds. Defaults: ``max_n`` 128 (the HTTP edge's cap so far; each choice
    is a sequence in every step); 256 stop strings of 8192 characters in all (a stop
    automaton of at most 8192 states: ~1 MB and a few ms to build, once per request);
    4096 stop token ids (the edge's cap so far; under ``min_tokens`` they travel in every
    step command as banned ids); 1024 ``logit_bias`` entries (they travel with the
    sequence the same way); ``max_logprobs`` 20 (vLLM's default)."""

    max_n: int = 128
    max_stop_strings: int = 256
    max_stop_chars: int = 8192
    max_stop_token_ids: int = 4096
    max_logprobs: int = MAX_LOGPROBS
    max_logit_bias: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            lo = 0 if f.name == "max_logprobs" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{f.name} must be an integer >= {lo}, got {v!r}")

    def check(self, params: SamplingParams) -> None:
        """``ValueError`` naming the first field of ``params`` over its limit."""
        if params.n > self.max_n:
            raise ValueError(f"SamplingParams.n must be <= {self.max_n} (max_n), got {params.n}")
        stop = params.stop or ()
        if len(stop) > self.max_stop_strings:
            raise ValueError(f"SamplingParams.stop holds {len(stop)} strings; at most "
                             f"{self.max_stop_strings} are allowed (max_stop_strings)")
        chars = sum(len(s) for s in stop)
        if chars > self.max_stop_chars:
            raise ValueError(f"SamplingParams.stop holds {chars} characters in all; at most "
                             f"{self.max_stop_chars} are allowed (max_stop_chars)")
        ids = params.stop_token_ids or ()
        if len(ids) > self.max_stop_token_ids:
            raise ValueError(f"SamplingParams.stop_token_ids holds {len(ids)} ids; at most "
                             f"{self.max_stop_token_ids} are allowed (max_stop_token_ids)")
        bias = params.logit_bias or {}
        if len(bias) > self.max_logit_bias:
            raise ValueError(f"SamplingParams.logit_bias holds {len(bias)} entries; at most "
                             f"{self.max_logit_bias} are allowed (max_logit_bias)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > self.max_logprobs:
                raise ValueError(f"SamplingParams.{name} must be <= {self.max_logprobs} "
                                 f"(max_logprobs), got {v}")

