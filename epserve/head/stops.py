"""Stop conditions of one completion: stop token ids, EOS, max/min tokens and stop strings.

Invariants: EOS and stop ids only end a completion once ``min_tokens`` tokens exist (before
that the sampler bans them, see ``banned_ids``); ``ignore_eos`` means EOS never stops. Stop
strings are matched by the request's ``StopAutomaton``: each check reads only the new text,
so it costs O(delta) whatever the number of stop strings, and ``safe_stream_len`` is O(1).
The rules are fixed at construction; the only mutable part is this completion's automaton
state (the text read so far, as two ints). Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epserve.head.outputs import FinishReason
from epserve.head.stop_automaton import StopAutomaton


@dataclass(slots=True, eq=False)
class StopChecker:
    """A completion's stop rules (built once per completion from its ``SamplingParams``).

    ``max_tokens``: resolved by the engine (never None here). A stop token id or EOS that ends
    the completion is not rendered as text unless ``include_stop_str_in_output`` (as vLLM):
    the engine reads that field when it detokenises the final token. ``automaton``: the
    request's ``StopAutomaton(stop)``, built once and shared by its ``n`` completions (None
    builds one here).

    Stop-string checks expect the text of one completion as it grows (each call's text
    extends the previous one's, as the detokeniser's does): then each reads only its delta.
    Any other text is still answered correctly, by re-reading its last ``max_stop_len``
    characters before the delta.
    """

    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]
    ignore_eos: bool
    min_tokens: int
    max_tokens: int
    include_stop_str_in_output: bool
    automaton: StopAutomaton | None = None
    _state: int = field(default=StopAutomaton.ROOT, init=False, repr=False)
    _read: int = field(default=0, init=False, repr=False)  # length of the text _state read

    def __post_init__(self) -> None:
        if any(not s for s in self.stop):
            raise ValueError(f"StopChecker: empty stop string in {self.stop!r}")
        if self.max_tokens < 1 or self.min_tokens < 0:
            raise ValueError(f"StopChecker: bad max_tokens={self.max_tokens} or min_tokens={self.min_tokens}")
        if self.automaton is None:
            self.automaton = StopAutomaton(self.stop)
        elif self.automaton.stops != tuple(self.stop):
            raise ValueError("StopChecker: the automaton was built for other stop strings")

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without stop strings)."""
        return self.automaton.max_len

    def _state_at(self, text: str, pos: int) -> int:
        """The automaton state after ``text[:pos]``: the kept one when it read exactly that
        (the text only grew), else rebuilt from the last ``max_stop_len`` characters (no
        longer suffix can be a state)."""
        if pos == self._read:
            return self._state
        a = self.automaton
        return a.step(a.ROOT, text, max(0, pos - a.max_len), pos, report=False)[0]

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
        """The first stop string that ends in the last ``delta_len`` chars: ``(truncation
        index, stop string)``, or None. The text is cut before the stop string, or after it
        when ``include_stop_str_in_output``. Costs O(delta_len) when ``full_text`` extends
        the text of the previous check.
        ``num_generated`` (output tokens so far), when given, gates stop strings by
        ``min_tokens`` too, as vLLM does: they count once there are more than ``min_tokens``
        tokens (the text of the first ``min_tokens`` is never cut), and one completed earlier
        does not stop later."""
        if not self.stop or delta_len <= 0:
            return None
        end = len(full_text)
        start = max(0, end - delta_len)
        # Read the delta even under min_tokens: the state must follow the text, and a stop
        # completed then is simply not reported (so it does not stop a later check either).
        gated = num_generated is not None and num_generated <= self.min_tokens
        # The stop that ends first wins (ties: the longer one); that is what a check after
        # every single character would find, so the result does not depend on delta sizes.
        state, found = self.automaton.step(self._state_at(full_text, start), full_text,
                                           start, end, report=not gated)
        self._state, self._read = state, end
        if found is None:
            return None
        stop_end, index = found
        s = self.stop[index]
        return (stop_end if self.include_stop_str_in_output else stop_end - len(s)), s

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
        n = len(full_text)
        return n - self.automaton.hold(self._state_at(full_text, n))
