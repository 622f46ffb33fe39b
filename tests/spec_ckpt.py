"""A tiny gated-DeltaNet hybrid checkpoint whose greedy continuation is predictable, for the
speculative-decoding tests: n-gram drafts of a random model's output are never accepted, so a
test of rollback after partial acceptance needs a model that counts.

Invariant: nothing is trained; the same arch gives the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tiny_ckpt import make_tiny_checkpoint


def make_successor_checkpoint(arch: str, out_dir: str | Path, **overrides) -> Path:
    """A tiny ``arch`` checkpoint whose greedy continuation of a token in [3, 300) is its
    successor, built without training: small random layers (their outputs stay small against
    the embedding) and an LM head row for token j along the embedding of j - 1. Its logprobs
    still depend on every layer and state (about -1 for the successor), and n-gram drafts of
    a counting run that recurs are accepted until the earlier run turned away."""
    path = make_tiny_checkpoint(arch, out_dir, initializer_range=0.02, **overrides)
    f = path / "model.safetensors"
    w = load_file(f)
    emb = w[next(k for k in w if k.endswith("embed_tokens.weight"))]
    j = torch.arange(3, 300)
    prev = emb[3 + (j - 4) % 297]
    w["lm_head.weight"][j] = 0.7 * prev / prev.norm(dim=1, keepdim=True)
    save_file(w, f, metadata={"format": "pt"})
    return path


def counting_prompts(seed: int = 7) -> list[list[int]]:
    """Counting runs that recur (the n-gram lookup drafts what followed them before), and
    random prompts."""
    import random

    rng = random.Random(seed)
    return [list(range(10, 21)) + list(range(50, 56)) + list(range(10, 14)),
            list(range(100, 110)) + [7, 8] + list(range(100, 104)),
            [rng.randrange(3, 300) for _ in range(13)], [rng.randrange(3, 300) for _ in range(4)]]
