"""Triton paged KV write: one launch stores both K and V rows into their flat cache slots.

Same contract as ``epserve.kernels.kv_write.write_kv_ref`` (the definition): row t's K/V
([Hkv, D] each) go to ``k_cache[slot // BS, slot % BS]`` / ``v_cache[...]`` with
``slot = slot_mapping[t]``, cast to the cache dtype (round to nearest even, as torch); a row
with ``slot < 0`` (CUDA-graph padding) writes nothing. Valid slots must be ``< NB * BS`` and
distinct (not checked: they live on the device).

Grid: (token, block of kv heads); each program copies a [BLOCK_H, D] tile of K and the same of
V. k and v may be strided views (e.g. slices of a fused qkv projection): any token and head
stride, last dim contiguous; the caches need a contiguous last dim (block, offset and head
strides free). CUDA-graph capturable: the skip is a store mask, never a host-side filter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import check_devices, check_kv_write_inputs, interpreted
from epserve.kernels.triton.pdl import pdl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                     block_size, num_heads, D,
                     BLOCK_H: tl.constexpr, D_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_P)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # slot < 0 (padding): no head is in range. A scalar bool in a tensor mask is refused by
    # newer Triton interpreters, so the skip is folded into the integer bound.
    live_heads = tl.where(slot >= 0, num_heads, 0)
    mask = (heads[:, None] < live_heads) & (offs_d[None, :] < D)
    blk = slot // block_size
    off = slot % block_size
    heads = heads.to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :],
                mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :],
                mask=mask, other=0.0)
    kc = kc_ptr + blk * stride_kcb + off * stride_kco + heads[:, None] * stride_kch
    vc = vc_ptr + blk * stride_vcb + off * stride_vco + heads[:, None] * stride_vch
    tl.store(kc + offs_d[None, :], k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc + offs_d[None, :], v.to(vc_ptr.dtype.element_ty), mask=mask)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
INTERPRETED = interpreted(_write_kv_kernel)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton ``write_kv_ref``, in place; rows whose slot is < 0 write nothing.

    k, v: [T, Hkv, D] (fp32/fp16/bf16, last dim contiguous); k_cache, v_cache: [NB, BS, Hkv, D]
    (fp32/fp16/bf16, last dim contiguous); slot_mapping: [T] int64 or int32, contiguous.
    """
    name = "write_kv_triton"
    t, hkv, d = check_kv_write_inputs(name, k, v, k_cache, v_cache, slot_mapping)
    check_devices(name, (k, v, k_cache, v_cache, slot_mapping), INTERPRETED,
                  "epserve.kernels.triton.kv_write")
    if t == 0 or hkv == 0 or d == 0:
        return
    slots = slot_mapping.contiguous()
    d_p = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(hkv), max(1, 2048 // d_p))
    grid = (t, triton.cdiv(hkv, block_h))
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], hkv, d,
        BLOCK_H=block_h, D_P=d_p, num_warps=4 if block_h * d_p >= 1024 else 2,
        **pdl(_write_kv_kernel))
