"""Repetition, frequency and presence penalties on a rank: each penalized slot's tokens, and a
step's penalty table for the sampler.

Owns, for every slot of this rank whose ``RowSampling`` has a penalty, the tokens the rank fed it
(prompt, then output: the prefill chunks and decode feeds, so a recomputed sequence refills it);
its first ``prompt_len`` tokens are the prompt. A step's table is built from that history plus
the step's own fed tokens, before anything is recorded; the tokens are recorded once the step ran
(``record``), so a refused step changes nothing. Invariants: a slot without penalties costs
nothing (no history, no table entry); a penalized sequence's whole prompt reaches its rank
(the KV book gives it no cached prefix and the mirror refuses one with KV it was not sent), and it
is never verified with drafts (the scheduler drafts nothing for it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

from epserve.models.sampling_rules import penalized
from epserve.models.traits import RowSampling


@dataclass(frozen=True, slots=True)
class PenaltyTable:
    """What the sampler applies after the logit bias: ``rep_*`` the (row, token) pairs of every
    prompt and output token with the row's repetition penalty (one pair per token);
    ``add_*`` (row, token, value) to add to output tokens' logits: -(frequency x count +
    presence)."""

    rep_rows: list[int]
    rep_toks: list[int]
    rep_vals: list[float]
    add_rows: list[int]
    add_toks: list[int]
    add_vals: list[float]


class PenaltyBook:
    """Per penalized slot: the tokens fed so far."""

    def __init__(self) -> None:
        self.history: dict[int, list[int]] = {}

    def start(self, slot: int, sampling: RowSampling) -> None:
        """A new sequence (or new sampling) in ``slot``."""
        if penalized(sampling):
            self.history.setdefault(slot, [])
        else:
            self.history.pop(slot, None)

    def drop(self, slot: int) -> None:
        self.history.pop(slot, None)

    def table(self, sampled_slots: Sequence[int], sampling: Sequence[RowSampling],
              fed: dict[int, list[int]], prompt_len: Callable[[int], int]) -> PenaltyTable | None:
        """The table for the step's sampled rows (``sampled_slots[i]`` samples row ``i`` with
        ``sampling[i]``); ``fed``: each penalized slot's tokens this step, in order."""
        if not self.history:
            return None
        t = PenaltyTable([], [], [], [], [], [])
        for i, (slot, s) in enumerate(zip(sampled_slots, sampling)):
            hist = self.history.get(slot)
            if hist is None or not penalized(s):
                continue
            tokens = hist + fed.get(slot, [])
            if s.repetition_penalty != 1.0:
                seen = sorted(set(tokens))
                t.rep_rows.extend([i] * len(seen))
                t.rep_toks.extend(seen)
                t.rep_vals.extend([s.repetition_penalty] * len(seen))
            if s.frequency_penalty or s.presence_penalty:
                for tok, c in sorted(Counter(tokens[prompt_len(slot):]).items()):
                    t.add_rows.append(i)
                    t.add_toks.append(tok)
                    t.add_vals.append(-(s.frequency_penalty * c + s.presence_penalty))
        return t if t.rep_rows or t.add_rows else None

    def fed(self, decode_slots: Sequence[int], decode_ids: Sequence[int],
            prefill: Sequence[tuple[int, Sequence[int]]]) -> dict[int, list[int]]:
        """Each penalized slot's tokens in a step: its decode feed or its prefill chunk."""
        out: dict[int, list[int]] = {}
        if not self.history:
            return out
        hist = self.history
        for s, t in zip(decode_slots, decode_ids):
            if s in hist:
                out.setdefault(s, []).append(int(t))
        for s, tokens in prefill:
            if s in hist:
                out.setdefault(s, []).extend(int(t) for t in tokens)
        return out

    def record(self, fed: dict[int, list[int]]) -> None:
        """The step ran: its fed tokens join their slots' histories."""
        for s, tokens in fed.items():
            if s in self.history:
                self.history[s].extend(tokens)
