"""Paged KV writes: each new row's K/V goes into its flat slot; the ref is the definition.

Invariants: ``slot_mapping[t]`` is ``block_id * block_size + offset`` for row t, or -1 for a
padded row, which writes nothing (CUDA-graph padding relies on it). K/V are cast to the
cache's dtype.

``write_kv`` runs ``epserve.kernels.triton.kv_write`` (one launch for K and V, CUDA-graph
capturable: padding is a store mask, not a boolean index) where ``dispatch.use_triton`` says so
and the layout is one it covers; the reference otherwise. ``Attention`` writes through
``rope.apply_qk_norm_rope(..., v=, k_cache=, v_cache=, slot_mapping=)`` instead: the same
write, fused into the q/k norm + rope launch.
"""

from __future__ import annotations

import torch

from epserve.kernels.dispatch import DTYPES, use_triton


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write each row's K/V into its slot, in place; rows with slot -1 write nothing.

    k, v: [T, Hkv, D]; k_cache, v_cache: [NB, BS, Hkv, D]; slot_mapping: [T] int64.
    """
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[valid].to(v_cache.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Public entry for ``write_kv_ref`` (same contract); picks the implementation."""
    check_kv_args("write_kv", k, v, k_cache, v_cache, slot_mapping)
    if _runs_triton(k, v, k_cache, v_cache, slot_mapping):
        from epserve.kernels.triton.kv_write import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def _runs_triton(k, v, k_cache, v_cache, slot_mapping) -> bool:
    """``use_triton`` and dtypes/layouts the kernel covers."""
    tensors = (k, v, k_cache, v_cache)
    if any(t.dtype not in DTYPES or t.stride(-1) != 1 for t in tensors):
        return False
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        return False
    if any(t.device != k.device for t in (v, k_cache, v_cache, slot_mapping)):
        return False
    return use_triton(k)


def check_kv_args(name: str, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Shape checks of a KV write, ValueError prefixed with ``name`` (the public entry): k, v
    [T, Hkv, D]; k_cache, v_cache [NB, BS, Hkv, D]; slot_mapping [T]."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, Hkv, D]")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"{name}: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                         f"[NB, BS, {k.shape[1]}, {k.shape[2]}]")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"{name}: slot_mapping shape {tuple(slot_mapping.shape)}, "
                         f"expected ({k.shape[0]},)")
