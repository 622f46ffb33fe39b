"""A paged KV cache for attention tests: random K/V blocks and block tables whose physical
blocks are a random permutation (each sequence's table scattered), one spare 0-padded column."""

from __future__ import annotations

import torch


def paged_kv(g: torch.Generator, lens: list[int], hkv: int, d: int, bs: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables) for sequences of KV lengths ``lens``."""
    s = len(lens)
    max_blocks = max(-(-n // bs) for n in lens) + 1
    nb = s * max_blocks + 3
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(s, max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // bs)
        tables[i, :used] = perm[i * max_blocks: i * max_blocks + used].int()
    return k_cache, v_cache, tables
