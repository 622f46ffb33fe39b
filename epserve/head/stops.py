"""Stop conditions of one completion: stop token ids, EOS, max/min tokens and stop strings.

Invariants: EOS and stop ids only end a completion once ``min_tokens`` tokens exist (before
that the sampler bans them, see ``banned_ids``); ``ignore_eos`` means EOS never stops; a stop
string is searched only in the tail a new delta could have completed, so a check costs
O(delta + longest stop), not O(text). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from epserve.head.outputs import FinishReason


@dataclass(frozen=True, slots=True)
class StopChecker:
    """A completion's stop rules (built once per completion from its ``SamplingParams``).

    ``max_tokens``: resolved by the engine (never None here). A stop token id or EOS that ends
    the completion is not rendered as text unless ``include_stop_str_in_output`` (as vLLM):
    the engine reads that field when it detokenises the final token.
    """

    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]
    ignore_eos: bool
    min_tokens: int
    max_tokens: int
    include_stop_str_in_output: bool

    def __post_init__(self) -> None:
        if any(not s for s in self.stop):
            raise ValueError(f"StopChecker: empty stop string in {self.stop!r}")
        if self.max_tokens < 1 or self.min_tokens < 0:
            raise ValueError(f"StopChecker: bad max_tokens={self.max_tokens} or min_tokens={self.min_tokens}")

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without stop strings)."""
        return max((len(s) for s in self.stop), default=0)

    def check_token(self, token_id: int, num_generated: int) -> tuple[FinishReason | None, int | str | None]:
        """Whether the just-generated ``token_id`` ends the completion.

        ``num_generated``: output tokens including this one. Returns ``(finish_reason,
        stop_reason)``: ("stop", id) for a stop id, ("stop", None) for EOS, ("length", None) at
        ``max_tokens``, (None, None) to go on. A stop/EOS token wins over "length".
        """
        if num_generated >= self.min_tokens:
            if token_id in self.stop_token_ids:
                return "stop", token_id
            if not self.ignore_eos and token_id in self.eos_token_ids:
                return "stop", None
        if num_generated >= self.max_tokens:
            return "length", None
        return None, None

    def find_stop(self, full_text: str, delta_len: int,
                  num_generated: int | None = None) -> tuple[int, str] | None:
        """The first stop string the last ``delta_len`` chars completed: ``(truncation index,
        stop string)``, or None. The text is cut before the stop string, or after it when
        ``include_stop_str_in_output``.
        ``num_generated`` (output tokens so far), when given, gates stop strings by
        ``min_tokens`` too, as vLLM does: one completed earlier does not stop later."""
        if not self.stop or delta_len <= 0:
            return None
        if num_generated is not None and num_generated < self.min_tokens:
            return None
        # A stop string completed by the delta ends inside it, so it starts at or after this.
        start = max(0, len(full_text) - delta_len - self.max_stop_len + 1)
        # The stop that ends first wins (ties: the longer one); that is what a check after
        # every single character would find, so the result does not depend on delta sizes.
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = full_text.find(s, start)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is None:
            return None
        end, i, s = best
        return (end if self.include_stop_str_in_output else i), s

    def check_text(self, full_text: str, delta_len: int, num_generated: int | None = None) -> int | None:
        """The truncation index when a stop string appeared in the new text, else None."""
        found = self.find_stop(full_text, delta_len, num_generated)
        return None if found is None else found[0]

    def banned_ids(self, num_generated: int) -> tuple[int, ...]:
        """Ids the sampler must not pick for the next token, ``num_generated`` tokens existing:
        stop ids and EOS (unless ``ignore_eos``: EOS then stops nothing) under ``min_tokens``."""
        if num_generated >= self.min_tokens:
            return ()
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids |= self.eos_token_ids
        return tuple(sorted(ids))

    def safe_stream_len(self, full_text: str) -> int:
        """Length of the prefix of ``full_text`` that can be streamed: the text minus its
        longest suffix that is a proper prefix of a stop string (it may yet become one).

        With ``include_stop_str_in_output`` nothing is held back: the stop string would be
        output anyway. Call it on text already cut by ``check_text``.
        """
        if not self.stop or self.include_stop_str_in_output:
            return len(full_text)
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full_text)), held, -1):
                if full_text.endswith(s[:k]):
                    held = k
                    break
        return len(full_text) - held
