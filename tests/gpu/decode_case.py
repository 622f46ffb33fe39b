"""The paged layout of a batch-of-decode-rows test case, shared by the GPU kernel tests."""

from __future__ import annotations

import torch


def decode_layout(lens: list[int], bs: int, g: torch.Generator, device: str = "cuda") -> dict:
    """One decode row per sequence of KV length ``lens[i]`` over shuffled blocks of ``bs``:
    ``tables`` [S, W] int32, ``pos`` [S] (the new token's position), ``slots`` [S] (its KV
    slot), ``lens`` [S] int32, ``nb`` blocks in all. With more than one row the last is
    CUDA-graph padding (slot -1, length 1, position 0)."""
    s = len(lens)
    width = max(-(-n // bs) for n in lens)
    nb = s * width + 4
    tables = torch.randperm(nb, device=device, generator=g)[:s * width].view(s, width).int()
    pos = torch.tensor([n - 1 for n in lens], device=device)
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs
                          for i, n in enumerate(lens)], device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    if s > 1:
        slots[-1], lens_t[-1], pos[-1] = -1, 1, 0
    return dict(tables=tables, pos=pos, slots=slots, lens=lens_t, nb=nb)
