"""The attention core of one layer's step: per-head q/k RMSNorm + RoPE with this step's K/V
written into the paged cache, then paged attention over it.

The definition is the two public ops in order, ``rope.apply_qk_norm_rope`` (with the KV write)
and ``attention.paged_attention``. A pure decode step on the Triton decode path
(``attention.use_triton_decode``) with caches in the decode kernel's layout runs both in one
launch (``epserve.kernels.triton.rope_decode``); every other step runs the two.
"""

from __future__ import annotations

import torch

from epserve.kernels.attention import AttentionMetadata, paged_attention, use_triton_decode
from epserve.kernels.dispatch import DTYPES
from epserve.kernels.rope import apply_qk_norm_rope


def rope_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k, v: [T, Hkv, D] (q and k are normed and rotated in place); caches
    [NB, BS, Hkv, D]; ``meta.slot_mapping`` says where this step's K/V go. Returns the
    attention output [T, Hq, D]."""
    if _fused(q, cos_cache, k_cache, v_cache, meta, sliding_window):
        from epserve.kernels.triton.rope_decode import rope_paged_decode_triton

        return rope_paged_decode_triton(q, k, v, positions, cos_cache, sin_cache, q_weight,
                                        k_weight, eps, k_cache, v_cache, meta.slot_mapping,
                                        meta.block_tables, meta.seq_lens_t, scale,
                                        sliding_window)
    apply_qk_norm_rope(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, eps, v=v,
                       k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping)
    return paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)


def _fused(q: torch.Tensor, cos_cache: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, meta: AttentionMetadata, sliding_window: int | None) -> bool:
    """A pure decode step with device lengths, on the Triton decode path, in its layout, full
    rotary (partial rotary runs the two public ops)."""
    if (meta.seq_lens_t is None or cos_cache.shape[-1] * 2 != q.shape[2]
            or not use_triton_decode(q, meta)):
        return False
    if sliding_window is not None and not (type(sliding_window) is int and sliding_window >= 1):
        return False
    if not (q.dtype in DTYPES and k_cache.dtype == q.dtype == v_cache.dtype
            and k_cache.shape == v_cache.shape and k_cache.is_contiguous()
            and v_cache.is_contiguous() and q.shape[2] % 2 == 0):
        return False
    # ``from <module> import name`` reads sys.modules (a test may swap the module).
    from epserve.kernels.triton.rope_decode import INTERPRETED

    return q.is_cuda or INTERPRETED  # a module compiled for the GPU cannot run on CPU
