"""Speculative decoding on the head: the user's ``speculative_config`` and its proposer.

``SpeculativeConfig.from_dict`` reads vLLM's shape (``{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``) and refuses at
start, naming the key, anything it cannot honour: an unknown key or method, a method not built
yet, a value out of range. The proposer drafts up to ``num_speculative_tokens`` tokens per
decode row; the model verifies them in the same step (``models.acceptance`` is the rule).
Invariant: speculation never changes what a request gets (greedy output is token-identical to
no speculation; sampled output is distributed exactly as the target's, and a seeded request
draws the same tokens), only how many forwards it takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from epserve.head.draft_proposer import DraftModelProposer
from epserve.head.ngram_proposer import NgramProposer
from epserve.models.traits import Model

#: Drafted tokens one row may carry (the step command's bound, ``MAX_DRAFT_TOKENS``).
MAX_SPECULATIVE_TOKENS = 16

#: vLLM's methods this engine does not run (yet): refused by name, never ignored.
_NOT_BUILT = {
    "eagle": "EAGLE draft heads are not supported", "eagle3": "EAGLE draft heads are not "
    "supported", "medusa": "Medusa heads are not supported", "mlp_speculator": "MLP "
    "speculators are not supported", "suffix": "suffix decoding is not supported",
}
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``ngram`` (prompt lookup over prompt and output), ``draft_model`` (a
    smaller checkpoint with the target's vocabulary, ``model``: its folder) or ``mtp`` (the
    target checkpoint's own MTP head: Qwen3-Next, Qwen3.5);
    ``num_speculative_tokens``: drafted tokens per row and step, 1..16;
    ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram): the n-gram lengths matched (as
    vLLM: one given sets the other, neither gives 5 and 5)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "SpeculativeConfig | None":
        """The config of ``d`` (None or empty: no speculation); ``ValueError`` naming the key."""
        if not d:
            return None
        if not isinstance(d, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {d!r}")
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(_KEYS))}")
        method = d.get("method")
        if method in _NOT_BUILT:
            raise ValueError(f"speculative_config.method={method!r}: {_NOT_BUILT[method]}")
        if method not in ("ngram", "draft_model", "mtp"):
            raise ValueError(f"speculative_config.method must be 'ngram', 'draft_model' or "
                             f"'mtp', got {method!r}")
        k = _int(d, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        if method == "mtp":
            extra = sorted(set(d) - {"method", "num_speculative_tokens"})
            if extra:
                raise ValueError(f"speculative_config.{extra[0]}: method 'mtp' drafts with "
                                 f"the target checkpoint's own MTP head and takes only "
                                 f"num_speculative_tokens")
            return cls(method, k)
        if method == "draft_model":
            extra = sorted(set(d) & {"prompt_lookup_min", "prompt_lookup_max"})
            if extra:
                raise ValueError(f"speculative_config.{extra[0]}: method 'draft_model' does no "
                                 f"n-gram lookup")
            if not isinstance(d.get("model"), str) or not d["model"]:
                raise ValueError("speculative_config.model: method 'draft_model' needs the "
                                 "draft checkpoint's folder")
            return cls(method, k, model=d["model"])
        if "model" in d:
            raise ValueError("speculative_config.model: method 'ngram' uses no draft model")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        lo = _int(d, "prompt_lookup_min", hi if hi is not None else 5, 1, 1 << 20)
        hi = _int(d, "prompt_lookup_max", lo, 1, 1 << 20)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min={lo} exceeds "
                             f"prompt_lookup_max={hi}")
        return cls(method, k, lo, hi)

    def to_dict(self) -> dict[str, Any]:
        if self.method == "mtp":
            return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "draft_model":
            return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                    "model": self.model}
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min,
                "prompt_lookup_max": self.prompt_lookup_max}

    def proposer(self, draft: Model | None = None
                 ) -> NgramProposer | DraftModelProposer | MtpProposer:
        """The proposer; ``draft``: the draft model (``draft_model``), built by the caller."""
        if self.method == "mtp":
            return MtpProposer()
        if self.method == "draft_model":
            if draft is None:
                raise ValueError("speculative_config: method 'draft_model' needs its model")
            return DraftModelProposer(draft)
        return NgramProposer(self.prompt_lookup_min, self.prompt_lookup_max)


def _int(d: Mapping[str, Any], key: str, default: Any, lo: int, hi: int) -> int:
    v = d.get(key, default)
    if v is None:
        raise ValueError(f"speculative_config.{key} is required")
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"speculative_config.{key} must be an integer in [{lo}, {hi}], "
                         f"got {v!r}")
    return v


class MtpProposer:
    """The target's own MTP head drafts on its rank after every step that samples a sequence
    (``ModelDraft``); this hands the scheduler those drafts (``SequenceState.drafts``), cut
    to each row's cap. Nothing is kept beside the sequence."""

    def propose_batch(self, seqs: Sequence[Any], caps: Sequence[int]) -> list[tuple[int, ...]]:
        return [tuple(s.state.drafts[:k]) if k > 0 and s.state is not None else ()
                for s, k in zip(seqs, caps)]

    def release(self, seq: Any) -> None:
        """Nothing held: the drafts live in the sequence's state."""


class Proposer(Protocol):
    """What the scheduler asks of a proposer: drafts for a step's decode rows in one batch (at
    most ``caps[i]`` for row ``i``; fewer or none is always allowed), and to let go of a
    sequence that finished or was preempted. A proposer keeps its per-sequence state in
    ``Sequence.draft_state``. ``NgramProposer``, ``DraftModelProposer`` and ``MtpProposer``
    implement it."""

    def propose_batch(self, seqs: Sequence[Any], caps: Sequence[int]) -> list[tuple[int, ...]]: ...
    def release(self, seq: Any) -> None: ...


@dataclass
class SpecStats:
    """vLLM's speculative-decoding counters: verify rows (``num_drafts``), tokens drafted and
    accepted, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None

    def record(self, drafts: Sequence[int], accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        per = self.accepted_per_pos
        if per is None or len(per) < len(drafts):
            per = self.accepted_per_pos = (per or []) + [0] * (len(drafts) - len(per or []))
        for i in range(accepted):
            per[i] += 1
