"""Token masks: packed bitmasks of the tokens a constrained row may sample, applied to logits.

The packing is xgrammar's (and vLLM's): a row's mask is ``ceil(V / 32)`` int32 words, token
``t`` allowed when bit ``t % 32`` of word ``t // 32`` is set; bits past the vocabulary are
ignored. Applying a mask sets every disallowed logit to -inf, before sampling, so greedy and
sampled rows alike (and their logprobs) see only the allowed tokens. Pure torch: the same ops
on CPU and CUDA, queued without a host sync (the words travel pinned and non-blocking).
"""

from __future__ import annotations

import numpy as np
import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def mask_words(vocab_size: int) -> int:
    """Words in one row's mask."""
    return -(-vocab_size // 32)


def unpack_mask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """words: [M, W] int32 -> allowed: [M, vocab_size] bool."""
    dev = words.device
    shifts = _SHIFTS.get(dev)
    if shifts is None:
        shifts = _SHIFTS[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    m, w = words.shape
    bits = (words.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [M, W, 32]
    return bits.view(m, w * 32)[:, :vocab_size].bool()


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def apply_token_masks(logits: torch.Tensor, rows: np.ndarray, words: np.ndarray) -> torch.Tensor:
    """Set ``logits[rows[i], t]`` to -inf for every token ``t`` that ``words[i]`` disallows,
    in place. logits: [R, V] float; rows: [M] int64 distinct row indices; words: [M, W]
    int32 with W = ``mask_words(V)``. Returns logits."""
    r, v = logits.shape
    if words.ndim != 2 or words.shape[0] != len(rows) or words.shape[1] != mask_words(v):
        raise ValueError(f"apply_token_masks: {len(rows)} rows, words of shape {words.shape}, "
                         f"{v} logits per row ({mask_words(v)} words)")
    if not len(rows):
        return logits
    dev = logits.device
    allowed = unpack_mask(_to(words.astype(np.int32, copy=False), dev), v)
    if len(rows) == r and np.array_equal(rows, np.arange(r)):
        return logits.masked_fill_(~allowed, float("-inf"))
    idx = _to(rows.astype(np.int64, copy=False), dev)
    sub = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, idx, sub)
