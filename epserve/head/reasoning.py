"""Reasoning models' thinking block as the engine sees it (vLLM's ``--reasoning-parser``).

Owns the parser names, the two tags and their token ids in the engine's vocabulary
(``ThinkTags``), and vLLM's rule for whether the reasoning has ended. The engine uses them for
two things: once a row's thinking closed (it generated ``</think>``, or its prompt ended with
the block closed: ``ThinkTags.closed_by``), both tags are banned for the rest of that row
(the seed's closed-thinking ``RowMask``: a sampling update adds them to the row's banned ids, so
thinking can never reopen, greedy and sampled alike); and a structured-output constraint holds
only after the reasoning has ended (vLLM's behaviour), unless it asks to hold inside it too.
Invariants: with a parser set, both tags are single tokens of the vocabulary (else the engine is
refused at start, as vLLM refuses it); without one nothing here runs. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

#: vLLM's names for the parsers this engine has; both use ``<think>`` / ``</think>``.
REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"
#: a prompt's last tokens that may hold the ``</think>`` closing its own turn
CLOSING_TAIL = 6


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """The token ids of ``<think>`` (``start``) and ``</think>`` (``end``)."""

    start: int
    end: int

    @classmethod
    def of(cls, parser: str | None, tokenizer: Any, vocab_size: int) -> "ThinkTags | None":
        """The tags of ``parser``'s model (None without a parser); ``ValueError`` naming
        ``reasoning_parser`` when the tokenizer lacks one of them or it is outside the
        model's vocabulary."""
        if parser is None:
            return None
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)}, "
                             f"got {parser!r}")
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        ids = [vocab.get(tag) for tag in (THINK_START, THINK_END)]
        if any(i is None or not 0 <= i < vocab_size for i in ids):
            raise ValueError(f"reasoning_parser={parser!r}: the model's tokenizer has no "
                             f"{THINK_START} and {THINK_END} tokens (the thinking tags this "
                             f"parser reads)")
        return cls(*ids)

    @property
    def ids(self) -> tuple[int, int]:
        return (self.start, self.end) if self.start < self.end else (self.end, self.start)

    def closed_by(self, ids: Sequence[int], decode: Callable[[list[int]], str]) -> bool:
        """Whether ``ids`` (a prompt) end a thinking block themselves: ``</think>`` followed by
        whitespace alone (``enable_thinking: false`` renders ``<think>\n\n</think>\n\n``; a
        prefilled answer may end so), among the last ``CLOSING_TAIL`` tokens. A ``</think>``
        further back, of an earlier turn (a tool loop's history), leaves the new turn free to
        think."""
        tail = list(ids[-CLOSING_TAIL:])
        if self.end not in tail:
            return False
        after = tail[len(tail) - tail[::-1].index(self.end):]
        return not after or not decode(after).strip()

    def last_tag(self, ids: Sequence[int]) -> int | None:
        """The last thinking tag among ``ids`` (``start`` or ``end``), None without one: the
        reasoning has ended after ``ids`` when it is ``end`` (vLLM's ``is_reasoning_end``)."""
        for t in reversed(ids):
            if t == self.start or t == self.end:
                return t
        return None
