"""The n-gram proposer (prompt lookup): drafts the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, for n from ``max_n`` down to ``min_n`` (continued
periodically where the history ends: a recent match is a repeating span).

No model runs. The search is a byte search over the token ids packed as 4-byte little-endian
words (``bytes.rfind``, C speed; a hit not on a word boundary is skipped), kept per sequence
and grown by the tokens added since the last call, so a step costs O(length) in C and O(new
tokens) in Python per row. Random-weight models fall into loops, which lookup predicts; real
models repeat spans of their prompt (code edits, quotes, extraction).
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence


class NgramProposer:
    """Per-sequence packed token history (``state``: held by the caller, one per sequence)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose_batch(self, seqs: Sequence[Any], caps: Sequence[int]) -> list[tuple[int, ...]]:
        """Drafts for head ``Sequence``s, at most ``caps[i]`` each; each sequence's packed
        history is kept in its ``draft_state``."""
        out = []
        for seq, k in zip(seqs, caps):
            if k <= 0:
                out.append(())
                continue
            d, seq.draft_state = self.propose(seq.request.prompt_ids, seq.output_ids, k,
                                              seq.draft_state)
            out.append(d)
        return out

    def release(self, seq: Any) -> None:
        """Nothing held beside the sequence (its history is rebuilt from its tokens)."""

    def propose(self, prompt: Sequence[int], output: Sequence[int], k: int,
                state: Any = None) -> tuple[tuple[int, ...], Any]:
        """Up to ``k`` drafted tokens after ``prompt + output`` (empty when no n-gram recurs),
        and the state to pass with the same sequence's next call (its history packed)."""
        n_tok = len(prompt) + len(output)
        packed: array = state if isinstance(state, array) and len(state) <= n_tok \
            else array("i")
        if len(packed) < len(prompt):
            packed.extend(prompt[len(packed):])
        packed.extend(output[len(packed) - len(prompt):])
        if k <= 0:
            return (), packed
        buf = packed.tobytes()
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            pat = buf[(n_tok - n) * 4:]
            end = (n_tok - 1) * 4  # an earlier occurrence, followed by at least one token
            while True:
                at = buf.rfind(pat, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    return _continue(packed, at // 4 + n, n_tok, k), packed
                end = at + len(pat) - 1
        return (), packed


def _continue(packed: array, start: int, n_tok: int, k: int) -> tuple[int, ...]:
    """The ``k`` tokens after the match ending at ``start``: what followed it, and past the
    end of the history the same text again (the match and the suffix are ``n_tok - start``
    tokens apart, so the text repeats with that period: a loop of one token drafts k of it)."""
    out = list(packed[start:start + k])
    period = n_tok - start
    while len(out) < k:
        out.append(out[len(out) - period])
    return tuple(out)
