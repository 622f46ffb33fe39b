"""The speculative acceptance rule, one definition for the head and every rank.

A verify row feeds a sequence's last token and ``k`` drafted tokens; the target samples a token
at each of the ``k + 1`` positions exactly as it would without speculation (the same logits
processing and the same draw, keyed by the row's seed and output index). Draft ``i`` is
accepted when the target's token at position ``i`` equals it and every earlier draft was
accepted; the emitted tokens are the target's tokens up to and including the first position
whose draft was rejected (or the bonus position after all ``k``).

Why this is exact: every emitted token is the target's own draw given the tokens before it,
so the output is distributed as the target's, token for token. For a deterministic (one-hot)
draft ``x`` it is the modified rejection rule of Leviathan et al. and Chen et al. realised as a
coupling: the draft is accepted with probability ``p(x)`` (the chance the target draws ``x``),
and on rejection the token is a draw from ``p`` without ``x``, renormalised (the target's draw
given that it is not ``x``), which is ``norm(max(0, p - q))`` for ``q`` one-hot at ``x``. Every
proposer here drafts deterministically (n-gram lookup, greedy draft models), so ``q`` is
always one-hot. A greedy row accepts the longest prefix equal to the target's argmax, plus the
target's next token. A seeded request draws the same noise at the same output index with or
without speculation, so its output is reproducible and the same as without speculation.
"""

from __future__ import annotations

from typing import Any, Sequence


def accepted(drafts: Sequence[int], run: Sequence[Any]) -> int:
    """How many of ``drafts`` are accepted given ``run``, the target's ``k + 1`` tokens (ids,
    or objects with ``token_id``); the tokens to emit are ``run[:accepted + 1]``."""
    n = 0
    for d, t in zip(drafts, run):
        if (t if isinstance(t, int) else t.token_id) != d:
            break
        n += 1
    return n
