"""The one definition of a valid row sampling: what the head accepts and what every rank checks.

Owns the value ranges of ``RowSampling``'s fields. ``SamplingParams`` (the head's edge, before
a request is queued) and ``EpMirror`` (every EP rank, before a step runs) both call
``row_sampling_problem``, so a value the ranks would refuse is refused at the edge first, with a
message naming the field. Invariants: pure Python, no torch; a ``RowSampling`` the head builds
from a request it accepted never has a problem here; a ``top_k`` at or above the vocabulary
size keeps every token (it is "off", as ``0`` is), so no request can be refused for asking too
many.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from epserve.models.traits import RowSampling

#: Most alternatives a request may ask for per token by default (vLLM's ``--max-logprobs``
#: default); an engine may be configured for more (``max_logprobs``, -1: the vocabulary).
MAX_LOGPROBS = 20

#: The largest bias a ``logit_bias`` entry adds or takes away (OpenAI's and vLLM's clamp).
MAX_LOGIT_BIAS = 100.0

#: Sampling seeds are unsigned 64-bit on the wire and in the sampler's hash.
SEED_BOUND = 2**64


def resolve_max_logprobs(option: int, vocab_size: int) -> int:
    """The engine option ``max_logprobs`` as a bound: ``-1`` is the vocabulary size (vLLM's
    meaning), any other value itself (the options' check refused what is below -1)."""
    return vocab_size if option == -1 else option


def _finite(v: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def penalized(s: "RowSampling") -> bool:
    """Whether a row's sampling applies any of the three penalties."""
    return bool(s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0)


def penalty_problem(presence: float, frequency: float,
                    repetition: float) -> tuple[str, str] | None:
    """``(field, what is wrong)`` for the first penalty out of vLLM's ranges, or None."""
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not (_finite(v) and -2 <= v <= 2):
            return name, f"must be a finite number in [-2, 2], got {v!r}"
    if not (_finite(repetition) and repetition > 0):
        return "repetition_penalty", f"must be a finite number > 0, got {repetition!r}"
    return None


def value_problem(temperature: float, top_p: float, top_k: int, min_p: float, seed: int,
                  logprobs: int | None,
                  max_logprobs: int | None = MAX_LOGPROBS) -> tuple[str, str] | None:
    """``(field, what is wrong)`` for the first out-of-range value, or None.

    The vocabulary-free part of the rule (what ``SamplingParams`` can judge alone);
    ``max_logprobs`` None: no bound but the sign (``SamplingParams`` does not know the
    engine's)."""
    if not (_finite(temperature) and temperature >= 0):
        return "temperature", f"must be a finite number >= 0, got {temperature!r}"
    if not (_finite(top_p) and 0 < top_p <= 1):
        return "top_p", f"must be in (0, 1], got {top_p!r}"
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        return "top_k", f"must be an int >= 0 (0 = off), got {top_k!r}"
    if not (_finite(min_p) and 0 <= min_p <= 1):
        return "min_p", f"must be in [0, 1], got {min_p!r}"
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_BOUND:
        return "seed", f"must be an int in [0, 2**64), got {seed!r}"
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or logprobs < 0
                                 or (max_logprobs is not None and logprobs > max_logprobs)):
        bound = "an int >= 0" if max_logprobs is None else f"an int in [0, {max_logprobs}]"
        return "logprobs", f"must be {bound} or None, got {logprobs!r}"
    return None


def token_ids_problem(ids: Sequence[int], vocab_size: int) -> str | None:
    """What is wrong with token ids that must name vocabulary entries, or None."""
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return None  # the common case, its loops in C (a prompt is checked on every arrival)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            return f"{t!r} is not a token id in [0, {vocab_size})"
    return None


def logit_bias_problem(pairs: Sequence[tuple[int, float]], vocab_size: int) -> str | None:
    """What is wrong with a row's ``logit_bias`` pairs (ids rising, each a vocabulary id; each
    bias finite and within +-``MAX_LOGIT_BIAS``), or None."""
    prev = -1
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            return f"{pair!r} is not a (token id, bias) pair"
        t, b = pair
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            return f"{t!r} is not a token id in [0, {vocab_size})"
        if t <= prev:
            return f"token id {t} is not above the one before it ({prev})"
        if not (_finite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
            return f"the bias of token {t} must be a finite number in [-{MAX_LOGIT_BIAS:g}, " \
                   f"{MAX_LOGIT_BIAS:g}], got {b!r}"
        prev = t
    return None


def row_sampling_problem(temperature: float, top_p: float, top_k: int, min_p: float, seed: int,
                         logprobs: int | None, banned: Sequence[int], vocab_size: int,
                         logit_bias: Sequence[tuple[int, float]] = (),
                         max_logprobs: int = MAX_LOGPROBS,
                         penalties: tuple[float, float, float] = (0.0, 0.0, 1.0),
                         ) -> tuple[str, str] | None:
    """``(field, what is wrong)`` for a row's sampling, or None when every rank accepts it.

    ``banned``: the ids the row may not sample now (stop ids and EOS under ``min_tokens``,
    the thinking tags once its thinking closed), which must be vocabulary ids;
    ``max_logprobs``: the engine's bound on ``logprobs``."""
    found = (value_problem(temperature, top_p, top_k, min_p, seed, logprobs, max_logprobs)
             or penalty_problem(*penalties))
    if found is not None:
        return found
    bad = token_ids_problem(banned, vocab_size)
    if bad is not None:
        return "banned_token_ids", bad
    bad = logit_bias_problem(logit_bias, vocab_size)
    return None if bad is None else ("logit_bias", bad)
