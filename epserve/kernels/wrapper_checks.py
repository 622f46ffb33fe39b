"""Argument checks shared by the Triton kernels' host wrappers.

Each raises ``ValueError`` naming the wrapper and the offending tensor; nothing here reads
device memory.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_paged_inputs(name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor) -> tuple[int, int, int, int, int]:
    """q [T, Hq, D] (last dim contiguous); caches [NB, BS, Hkv, D] contiguous, q's dtype (one of
    ``DTYPES``), Hq a multiple of Hkv; block_tables [S, max_blocks] int32, last dim contiguous.
    Returns ``(T, Hq, D, BS, Hkv)``."""
    if q.dim() != 3:
        raise ValueError(f"{name}: q {tuple(q.shape)} must be [T, Hq, D]")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must "
                         f"both be [NB, BS, Hkv, D]")
    t, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"{name}: q head_dim {d} != cache head_dim {dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{name}: {hq} query heads is not a multiple of {hkv} kv heads")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{name}: dtypes q {q.dtype}, k_cache {k_cache.dtype}, v_cache "
                         f"{v_cache.dtype} must be equal and one of {DTYPES}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{name}: k_cache and v_cache must be contiguous")
    if q.stride(2) != 1:
        raise ValueError(f"{name}: q must have a contiguous last dim, strides {q.stride()}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables {tuple(block_tables.shape)} {block_tables.dtype} "
                         f"must be [S, max_blocks] int32 with a contiguous last dim")
    return t, hq, d, bs, hkv


def check_kv_write_inputs(name: str, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> tuple[int, int, int]:
    """k, v [T, Hkv, D]; caches [NB, BS, Hkv, D]; all four one of ``DTYPES`` (each its own) with a
    contiguous last dim (other strides free); slot_mapping [T] int64 or int32. Returns
    ``(T, Hkv, D)``."""
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                         f"[T, Hkv, D]")
    t, hkv, d = k.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (hkv, d):
        raise ValueError(f"{name}: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must "
                         f"both be [NB, BS, {hkv}, {d}]")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: slot_mapping {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype} must be [{t}] int64 or int32")
    dtypes = (k.dtype, v.dtype, k_cache.dtype, v_cache.dtype)
    if any(dt not in DTYPES for dt in dtypes):
        raise ValueError(f"{name}: k, v, k_cache, v_cache dtypes {dtypes} must be in {DTYPES}")
    if any(x.stride(-1) != 1 for x in (k, v, k_cache, v_cache)) and d > 1:
        raise ValueError(f"{name}: k, v, k_cache, v_cache need a contiguous last dim")
    return t, hkv, d


def check_devices(name: str, tensors, interpreted: bool, module: str) -> None:
    """All ``tensors`` on one device, and that device CUDA unless ``module``'s kernels were
    defined under the Triton interpreter (``interpreted``)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on several devices {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"{name}: {device} tensors need TRITON_INTERPRET=1 when "
                         f"{module} is first imported")
