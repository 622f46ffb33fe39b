"""Rotary position embedding, rotate-half (GPT-NeoX) layout as in HF Llama/Qwen/Mixtral.

Invariants: the cos/sin cache is float32, ``[P, D/2]``, with ``inv_freq`` and angles computed
exactly as transformers' default rope does; dimension ``i < D/2`` is paired with ``i + D/2``.
The rotation runs in float32 and returns the inputs' dtype.
"""

from __future__ import annotations

import torch


def build_rope_cache(head_dim: int, max_positions: int, theta: float,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, head_dim // 2] float32 for the default (unscaled) rope."""
    if head_dim % 2:
        raise ValueError(f"build_rope_cache: head_dim must be even, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)  # [D/2]
    positions = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    angles = positions[:, None] * inv_freq[None, :]  # [P, D/2]
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, Hx, D]; cos, sin: [T, 1, D/2] float32. Returns [T, Hx, D] x.dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
             sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their token's position.

    q: [T, Hq, D]; k: [T, Hkv, D]; positions: [T] int64; cos_cache, sin_cache: [P, D/2]
    float32. Returns (q, k) rotated, same shapes and dtypes.
    """
    cos = cos_cache[positions][:, None, :]  # [T, 1, D/2]
    sin = sin_cache[positions][:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Public entry for ``rope_ref`` (same contract)."""
    if q.shape[-1] != k.shape[-1] or cos_cache.shape[-1] * 2 != q.shape[-1]:
        raise ValueError(f"apply_rope: q {tuple(q.shape)}, k {tuple(k.shape)} and cache "
                         f"{tuple(cos_cache.shape)} disagree on head_dim")
    # Dispatch point: a Triton kernel for CUDA tensors goes here.
    return rope_ref(q, k, positions, cos_cache, sin_cache)
