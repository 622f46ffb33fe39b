"""Rotary position embedding, rotate-half (GPT-NeoX) layout as in HF Llama/Qwen/Mixtral.

Invariants: the cos/sin cache is float32, ``[P, R/2]`` for ``R`` rotary dims, with
``inv_freq`` and angles computed exactly as transformers' default rope does; dimension
``i < R/2`` is paired with ``i + R/2``. Usually ``R`` is the head dim ``D``; with partial rotary
(Qwen3-Next, Qwen3.5: ``R = D * partial_rotary_factor``) only the first ``R`` dims of each head
rotate and the rest pass through. The rotation runs in float32 and returns the inputs' dtype.

``apply_qk_norm_rope`` (per-head q/k RMSNorm, then rope; optionally this step's paged KV write
too) runs ``epserve.kernels.triton.rope`` (one launch, in place, CUDA-graph capturable) where
``dispatch.use_triton`` says so and the layout is one it covers (partial rotary included); the
reference (then ``write_kv``) otherwise. With ``zero_centred`` the q/k norm weights are the
hybrids' zero-centred ones (``zero_centred_rms_norm_ref``: ``1 + w`` in float32).
"""

from __future__ import annotations

import torch

from epserve.kernels.dispatch import DTYPES, use_triton
from epserve.kernels.kv_write import check_kv_args, write_kv
from epserve.kernels.norm import rms_norm_ref, zero_centred_rms_norm_ref


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
    """x: [T, Hx, D]; cos, sin: [T, 1, R/2] float32 (R <= D: the first R dims rotate).
    Returns [T, Hx, D] x.dtype."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:2 * half]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half < x.shape[-1]:  # partial rotary: the rest passes through
        parts.append(xf[..., 2 * half:])
    return torch.cat(parts, dim=-1).to(x.dtype)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
             sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their token's position.

    q: [T, Hq, D]; k: [T, Hkv, D]; positions: [T] int64; cos_cache, sin_cache: [P, R/2]
    float32 (R <= D rotary dims). Returns (q, k) rotated, same shapes and dtypes.
    """
    cos = cos_cache[positions][:, None, :]  # [T, 1, R/2]
    sin = sin_cache[positions][:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
               sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Public entry for ``rope_ref`` (same contract)."""
    if q.shape[-1] != k.shape[-1] or cos_cache.shape[-1] * 2 > q.shape[-1]:
        raise ValueError(f"apply_rope: q {tuple(q.shape)}, k {tuple(k.shape)} and cache "
                         f"{tuple(cos_cache.shape)} disagree on head_dim")
    # Dispatch point: a Triton kernel for CUDA tensors goes here.
    return rope_ref(q, k, positions, cos_cache, sin_cache)


def apply_qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                           cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                           q_weight: torch.Tensor | None = None,
                           k_weight: torch.Tensor | None = None,
                           eps: float = 1e-6, zero_centred: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q / k over D with q_weight / k_weight [D] (each only when given;
    ``zero_centred_rms_norm_ref`` with ``zero_centred``), then ``rope_ref``. Shapes as
    ``rope_ref``; returns new (q, k), inputs untouched."""
    norm = zero_centred_rms_norm_ref if zero_centred else rms_norm_ref
    if q_weight is not None:
        q = norm(q, q_weight, eps)
    if k_weight is not None:
        k = norm(k, k_weight, eps)
    return rope_ref(q, k, positions, cos_cache, sin_cache)


def apply_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                       cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                       q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                       eps: float = 1e-6, *, v: torch.Tensor | None = None,
                       k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                       slot_mapping: torch.Tensor | None = None, zero_centred: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Public entry for ``apply_qk_norm_rope_ref``, IN PLACE on every path; with the KV
    arguments it then also writes this step's K/V as ``write_kv_ref(k, v, k_cache, v_cache,
    slot_mapping)`` on the normed + rotated k (one launch on the Triton path).

    q: [T, Hq, D]; k: [T, Hkv, D] (may be strided views, e.g. of one fused qkv output);
    positions: [T]; cos_cache, sin_cache: [P, R/2] (R <= D: partial rotary when less);
    q_weight, k_weight: [D] or None (zero-centred with ``zero_centred``). Writes the result into
    q and k and returns
    them (the same objects). v: [T, Hkv, D]; k_cache, v_cache:
    [NB, BS, Hkv, D]; slot_mapping: [T] (-1: a padded row, writes nothing); all four or none.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"apply_qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
                         f"[T, Hq, D] and [T, Hkv, D]")
    d = q.shape[2]
    if cos_cache.shape[-1] * 2 > d or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"apply_qk_norm_rope: q {tuple(q.shape)} and caches "
                         f"{tuple(cos_cache.shape)} / {tuple(sin_cache.shape)} disagree on head_dim")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and tuple(w.shape) != (d,):
            raise ValueError(f"apply_qk_norm_rope: {name} {tuple(w.shape)} must be [{d}]")
    kv = (v, k_cache, v_cache, slot_mapping)
    given = [n for n, x in zip(("v", "k_cache", "v_cache", "slot_mapping"), kv) if x is not None]
    with_kv = len(given) == len(kv)
    if given and not with_kv:
        raise ValueError(f"apply_qk_norm_rope: v, k_cache, v_cache and slot_mapping go together "
                         f"(all or none); got only {', '.join(given)}")
    if with_kv:
        check_kv_args("apply_qk_norm_rope", k, v, k_cache, v_cache, slot_mapping)
    if _runs_triton(q, k, positions, cos_cache, sin_cache, q_weight, k_weight,
                    kv if with_kv else ()):
        from epserve.kernels.triton.rope import qk_norm_rope_triton

        return qk_norm_rope_triton(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, eps,
                                   v=v, k_cache=k_cache, v_cache=v_cache,
                                   slot_mapping=slot_mapping, zero_centred=zero_centred)
    q_new, k_new = apply_qk_norm_rope_ref(q, k, positions, cos_cache, sin_cache, q_weight,
                                          k_weight, eps, zero_centred)
    q.copy_(q_new)
    k.copy_(k_new)
    if with_kv:
        write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def _runs_triton(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, kv=()) -> bool:
    """``use_triton`` and a layout the kernel covers (an even head dim, full or partial rotary,
    no zero-width cache); ``kv``: (v, k_cache, v_cache, slot_mapping) when the KV write is fused
    in, else empty."""
    if (cos_cache.dim() != 2 or cos_cache.shape[-1] < 1 or q.shape[-1] % 2
            or q.dtype not in DTYPES or k.dtype != q.dtype
            or q.stride(2) != 1 or k.stride(2) != 1 or cos_cache.stride(-1) != 1
            or sin_cache.stride(-1) != 1 or positions.dtype not in (torch.int64, torch.int32)):
        return False
    if kv:
        v, k_cache, v_cache, slot_mapping = kv
        if (any(x.dtype not in DTYPES or x.stride(-1) != 1 for x in (v, k_cache, v_cache))
                or slot_mapping.dtype not in (torch.int64, torch.int32)):
            return False
    tensors = [k, positions, cos_cache, sin_cache, *kv] + [w for w in (q_weight, k_weight)
                                                           if w is not None]
    if any(t.device != q.device for t in tensors):
        return False
    return use_triton(q)
