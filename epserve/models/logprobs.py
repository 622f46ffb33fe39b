"""Log-probability helpers of the seed's traits module: ``logprob_of``, ``bf16_to_f32``,
``extract_bf16`` and ``PromptTokenLogprob``, with its exact semantics.

Invariants: pure Python, no torch; a target outside the vocab or empty logits give ``-inf``
and never raise; top-k lists are highest first, ties keeping the lower token id first.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class PromptTokenLogprob:
    """One scored prompt position: log P(tokens[i+1] | tokens[..=i]) plus top-k alternatives.

    ``top``: ``(token_id, logprob)`` pairs, highest first, under the same distribution.
    ``rank``: the token's rank there as vLLM's (the vocabulary tokens at least as likely,
    itself included), None when not known.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


def logprob_of(f32_logits: Sequence[float], target: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-softmax over ``f32_logits``: the target's logprob and the top-k, highest first.

    ``k == 0`` gives no alternatives. A target outside the vocab, or empty logits, gives
    ``-inf`` (and no exception). Ties keep the lower token id first.
    """
    n = len(f32_logits)
    if n == 0:
        return -math.inf, []
    vals = [float(x) for x in f32_logits]
    m = max(vals)
    if math.isinf(m) and m < 0:
        lse = -math.inf
    else:
        lse = m + math.log(sum(math.exp(v - m) for v in vals))
    target_lp = vals[target] - lse if 0 <= target < n else -math.inf
    if k <= 0:
        return target_lp, []
    order = sorted(range(n), key=lambda i: (-vals[i], i))[:k]
    return target_lp, [(i, vals[i] - lse) for i in order]


def bf16_to_f32(two_bytes: bytes) -> float:
    """BF16 to FP32: the two little-endian bytes become the upper 16 bits of an f32."""
    if len(two_bytes) != 2:
        raise ValueError(f"bf16_to_f32: need 2 bytes, got {len(two_bytes)}")
    bits = (two_bytes[1] << 24) | (two_bytes[0] << 16)
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def extract_bf16(row: bytes, target: int, k: int) -> PromptTokenLogprob:
    """One position's ``PromptTokenLogprob`` from a row of vocab BF16 logits (little endian)."""
    if len(row) % 2:
        raise ValueError(f"extract_bf16: odd byte count {len(row)}")
    logits = [bf16_to_f32(row[i : i + 2]) for i in range(0, len(row), 2)]
    lp, top = logprob_of(logits, target, k)
    rank = (sum(v >= logits[target] for v in logits) if 0 <= target < len(logits)
            else None)  # vLLM's: the tokens at least as likely, itself included
    return PromptTokenLogprob(token_id=target, logprob=lp, top=tuple(top), rank=rank)


