"""``SamplingParams``: the per-request sampling knobs as vLLM users write them.

Invariants: an instance that exists is valid (``__post_init__`` raises ``ValueError`` naming
the field and the bad value otherwise); ``stop`` is a tuple of non-empty strings and
``stop_token_ids`` a tuple of ints >= 0; ``top_k`` -1 is accepted and means off, like 0;
``logit_bias`` is None or a dict of ids rising to biases clamped to [-100, 100].
Pure Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from epserve.head.structured_params import StructuredOutputsParams, as_structured
# MAX_LOGPROBS: re-exported (the default bound of the engine's max_logprobs)
from epserve.models.sampling_rules import (  # noqa: F401
    MAX_LOGIT_BIAS, MAX_LOGPROBS, penalty_problem, value_problem,
)
from epserve.models.traits import RowSampling

#: The largest ``top_k`` that travels; a larger one keeps every token all the same.
TOP_K_WIRE_MAX = 2**31 - 1

#: Temperatures at or below this sample greedily: dividing logits by a smaller value only
#: overflows float32 and gives the argmax anyway (vLLM uses the same threshold).
GREEDY_TEMPERATURE_EPS = 1e-5


def _is_int(v: Any) -> bool:
    # bool is a subclass of int, but True as a token count is always a caller mistake.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool))


def _bad(name: str, value: Any, need: str) -> ValueError:
    return ValueError(f"SamplingParams.{name} {need}, got {value!r}")


def _check_int(name: str, value: Any, lo: int, hi: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    need = f"must be an int >= {lo}" + (f" and <= {hi}" if hi is not None else "")
    if optional:
        need += " or None"
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        raise _bad(name, value, need)


def _check_real(name: str, value: Any, lo: float, hi: float, lo_open: bool) -> None:
    interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
    if not _is_real(value) or not math.isfinite(value):
        raise _bad(name, value, f"must be a finite number in {interval}")
    if value > hi or value < lo or (lo_open and value == lo):
        raise _bad(name, value, f"must be in {interval}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _bad(name, value, "must be a bool")


def _normalise_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items: Sequence[Any] = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise _bad("stop", stop, "must be a str, a list of str or None")
    for s in items:
        if not isinstance(s, str) or not s:
            raise _bad("stop", stop, "must hold only non-empty strings")
    # Duplicates change nothing but the search cost; keep the first of each, in order.
    return tuple(dict.fromkeys(items))


def _normalise_stop_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple, set, frozenset)):
        raise _bad("stop_token_ids", ids, "must be a list of ints >= 0 or None")
    for t in ids:
        if not _is_int(t) or t < 0:
            raise _bad("stop_token_ids", ids, "must hold only ints >= 0")
    return tuple(dict.fromkeys(sorted(ids) if isinstance(ids, (set, frozenset)) else ids))


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    """``{token id: bias}`` with ids rising and each bias clamped to +-``MAX_LOGIT_BIAS`` (as
    vLLM's OpenAI server clamps them); None or an empty dict is no bias."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _bad("logit_bias", bias, "must be a dict of token id -> bias or None")
    for t, b in bias.items():
        if not _is_int(t) or t < 0 or not _is_real(b) or not math.isfinite(b):
            raise ValueError(f"SamplingParams.logit_bias must map token ids (ints >= 0) to "
                             f"finite numbers ({t!r}: {b!r} does not), got {bias!r:.200}")
    return {t: float(min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias[t])))
            for t in sorted(bias)} or None


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample one request's completions (the vLLM keyword constructor and defaults).

    ``temperature`` 0 is greedy. ``top_k`` 0 or -1, ``top_p`` 1 and ``min_p`` 0 are off.
    ``seed``: None lets the engine pick one per request. ``max_tokens`` None: up to the
    context limit (the engine resolves it). ``min_tokens``: EOS and ``stop_token_ids`` are
    banned until that many tokens exist. ``logprobs`` / ``prompt_logprobs``: alternatives per
    token (0 returns only the chosen/prompt token's logprob), at most the engine's
    ``max_logprobs``. ``structured_outputs``: what the output must match
    (``StructuredOutputsParams``, or its fields as a dict); it ends with finish reason "stop"
    when the grammar is complete. ``logit_bias``: ``{token id: bias}`` added to the logits
    before sampling (the logprobs stay raw), each bias clamped to [-100, 100]; an id outside
    the model's vocabulary is refused by the engine. ``presence_penalty`` /
    ``frequency_penalty`` ([-2, 2]) and ``repetition_penalty`` (> 0) are vLLM's (see
    ``RowSampling``); a penalized request drafts no speculative tokens and reads no cached
    prefix (its rank needs the whole prompt).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "must be a finite number >= 0")
        _check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be an int >= 0, or -1 (off)")
        _check_real("min_p", self.min_p, 0.0, 1.0, lo_open=False)
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, "must be an int or None")
        # The rule every EP rank applies to the row this request becomes (models.sampling_rules):
        # checked here too, so nothing a rank would refuse gets past the edge.
        found = value_problem(self.temperature, self.top_p, max(self.top_k, 0), self.min_p, 0,
                              self.logprobs if _is_int(self.logprobs) else None, None)
        found = found or penalty_problem(self.presence_penalty, self.frequency_penalty,
                                         self.repetition_penalty)
        if found is not None:
            raise ValueError(f"SamplingParams.{found[0]} {found[1]}")
        _check_int("max_tokens", self.max_tokens, 1, optional=True)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        # the engine bounds both by its max_logprobs (head.limits)
        _check_int("logprobs", self.logprobs, 0, optional=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, optional=True)
        # Frozen: normalised values go in through object.__setattr__, once, here.
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "structured_outputs", as_structured(self.structured_outputs))
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        """True when the row samples by argmax (temperature at or below the greedy epsilon)."""
        return self.temperature <= GREEDY_TEMPERATURE_EPS

    def to_row_sampling(self, seed: int, banned: tuple[int, ...]) -> RowSampling:
        """The runner-side ``RowSampling``: ``seed`` is the resolved per-sequence seed (the
        request's, or one the engine drew), ``banned`` the ids masked at this step."""
        return RowSampling(
            temperature=0.0 if self.is_greedy else float(self.temperature),
            top_p=float(self.top_p),
            # any k at or above the vocabulary keeps every token: k past int32 means the same
            # and fits the step command's fields
            top_k=min(max(self.top_k, 0), TOP_K_WIRE_MAX),
            min_p=float(self.min_p),
            seed=seed,
            banned_token_ids=tuple(banned),
            logprobs=self.logprobs,
            logit_bias=tuple(self.logit_bias.items()) if self.logit_bias else (),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
        )
