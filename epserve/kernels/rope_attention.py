"""The attention core of one layer's step: per-head q/k RMSNorm + RoPE with this step's K/V
written into the paged cache, then paged attention over it.

The definition is the two public ops in order, ``rope.apply_qk_norm_rope`` (with the KV write)
and ``attention.paged_attention``, then, for the hybrids' gated attention (a ``gate``), the
output times ``sigmoid(gate)`` (``attention_gate_ref``). A pure decode step on the Triton decode
path (``attention.use_triton_decode``) with caches in the decode kernel's layout runs all of it
in one launch (``epserve.kernels.triton.rope_decode``: partial rotary, zero-centred q/k norms
and the gate included); every other step runs the two ops, then the gate in torch.
"""

from __future__ import annotations

import torch

from epserve.kernels.attention import AttentionMetadata, paged_attention, use_triton_decode
from epserve.kernels.dispatch import DTYPES
from epserve.kernels.rope import apply_qk_norm_rope


def attention_gate_ref(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gated attention's output gate: ``out * sigmoid(gate)`` (both [T, Hq, D]), in out's
    dtype (the sigmoid rounded to the gate's first, as torch's eager ops)."""
    return out * torch.sigmoid(gate)


def rope_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, *,
                    zero_centred: bool = False, gate: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k, v: [T, Hkv, D] (q and k are normed and rotated in place; cos/sin
    caches of R/2 <= D/2 columns); caches [NB, BS, Hkv, D]; ``meta.slot_mapping`` says where
    this step's K/V go; ``zero_centred``: the q/k norm weights are zero-centred; gate: [T, Hq,
    D] or None. Returns the attention output [T, Hq, D] (gated where a gate is given)."""
    if _fused(q, cos_cache, k_cache, v_cache, meta, sliding_window, gate):
        from epserve.kernels.triton.rope_decode import rope_paged_decode_triton

        return rope_paged_decode_triton(q, k, v, positions, cos_cache, sin_cache, q_weight,
                                        k_weight, eps, k_cache, v_cache, meta.slot_mapping,
                                        meta.block_tables, meta.seq_lens_t, scale,
                                        sliding_window, zero_centred=zero_centred, gate=gate)
    apply_qk_norm_rope(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, eps, v=v,
                       k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping,
                       zero_centred=zero_centred)
    out = paged_attention(q, k_cache, v_cache, meta, scale, sliding_window)
    return out if gate is None else attention_gate_ref(out, gate)


def _fused(q: torch.Tensor, cos_cache: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, meta: AttentionMetadata, sliding_window: int | None,
           gate: torch.Tensor | None = None) -> bool:
    """A pure decode step with device lengths, on the Triton decode path, in its layout (full
    or partial rotary; a gate in the kernel's dtypes with a contiguous last dim)."""
    if (meta.seq_lens_t is None or not 1 <= cos_cache.shape[-1] <= q.shape[2] // 2
            or not use_triton_decode(q, meta)):
        return False
    if gate is not None and (gate.shape != q.shape or gate.dtype not in DTYPES
                             or gate.stride(-1) != 1 or gate.device != q.device):
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
