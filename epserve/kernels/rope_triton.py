"""Triton per-head q/k RMSNorm (optional) + rotate-half RoPE in one launch, in place.

Same result as ``epserve.kernels.rope.apply_qk_norm_rope_ref`` (the definition): each head of
q (and k) is RMS-normalised over D with ``q_weight`` (``k_weight``) when that weight is given
(Qwen3) and left as is when it is None (Mixtral, Llama), then rotated by its token's position
(dim ``i < D/2`` paired with ``i + D/2``). Rounding follows the refs: the normalised value is
cast to the input dtype before the float32 weight multiply and the product cast again; the
rotation reads that rounded value in float32 (no fused multiply-add, so each product is rounded
as in torch's eager ops) and casts the result to the input dtype.

With ``v``, ``k_cache``, ``v_cache`` and ``slot_mapping`` given, the same launch also does
``epserve.kernels.kv_write.write_kv_ref(k, v, k_cache, v_cache, slot_mapping)`` on the result
(saving the KV-write launch): the rotated k (already rounded to k's dtype) and v's head go to
slot ``slot_mapping[t]`` cast to the cache dtype; a row with slot < 0 (CUDA-graph padding)
writes nothing. Valid slots must be ``< NB * BS`` and distinct (not checked: device data).

Grid: one program per (token, head) over the ``Hq + Hkv`` heads of q then k, so a decode step
of T tokens is a single launch. Each program reads its head's two halves, then overwrites them;
heads never overlap, so the in-place update is race free; a k head's program also writes that
head's K and V cache rows. q, k and v may be strided views (e.g. slices of one fused qkv
projection output viewed as [T, H, D]): any token (row) stride and head stride, last dim
contiguous; the caches need a contiguous last dim (block, offset and head strides free).
CUDA-graph capturable: no host syncs, no allocation; the padding skip is a store mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.wrapper_checks import check_devices, check_kv_write_inputs

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _norm_rope_head(ptr, w_ptr, cos, sin, offs, mask, eps, HALF, HAS_W: tl.constexpr):
    """Normalise (when HAS_W) and rotate the D = 2 * HALF values at ``ptr``, in place. Returns
    the two stored halves (in the input dtype)."""
    x1 = tl.load(ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_W:
        mean_sq = (tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / (2 * HALF)
        rstd = tl.rsqrt(mean_sq + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        a = (w1 * (a * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        b = (w2 * (b * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = (a * cos - b * sin).to(dtype)
    o2 = (b * cos + a * sin).to(dtype)
    tl.store(ptr + offs, o1, mask=mask)
    tl.store(ptr + HALF + offs, o2, mask=mask)
    return o1, o2


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                         v_ptr, kc_ptr, vc_ptr, slot_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_pos,
                         stride_cos, stride_sin, num_q_heads, HALF, eps,
                         stride_vt, stride_vh, stride_slot, block_size,
                         stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
                         HALF_P: tl.constexpr, HAS_QW: tl.constexpr, HAS_KW: tl.constexpr,
                         WRITE_KV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF_P)
    mask = offs < HALF
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
    if h < num_q_heads:
        _norm_rope_head(q_ptr + t * stride_qt + h * stride_qh, qw_ptr, cos, sin, offs, mask,
                        eps, HALF, HAS_QW)
    else:
        kh = (h - num_q_heads).to(tl.int64)
        k1, k2 = _norm_rope_head(k_ptr + t * stride_kt + kh * stride_kh, kw_ptr, cos, sin, offs,
                                 mask, eps, HALF, HAS_KW)
        if WRITE_KV:
            slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
            # slot < 0 (padding): no element is in range. A scalar bool in a tensor mask is
            # refused by newer Triton interpreters, so the skip is folded into the integer bound.
            live = offs < tl.where(slot >= 0, HALF, 0)
            blk = slot // block_size
            off = slot % block_size
            kc = kc_ptr + blk * stride_kcb + off * stride_kco + kh * stride_kch
            tl.store(kc + offs, k1.to(kc_ptr.dtype.element_ty), mask=live)
            tl.store(kc + HALF + offs, k2.to(kc_ptr.dtype.element_ty), mask=live)
            vrow = v_ptr + t * stride_vt + kh * stride_vh
            v1 = tl.load(vrow + offs, mask=live, other=0.0)
            v2 = tl.load(vrow + HALF + offs, mask=live, other=0.0)
            vc = vc_ptr + blk * stride_vcb + off * stride_vco + kh * stride_vch
            tl.store(vc + offs, v1.to(vc_ptr.dtype.element_ty), mask=live)
            tl.store(vc + HALF + offs, v2.to(vc_ptr.dtype.element_ty), mask=live)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
_INTERPRETED = type(_qk_norm_rope_kernel).__name__ == "InterpretedFunction"


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                        cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                        q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        eps: float = 1e-6, *, v: torch.Tensor | None = None,
                        k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                        slot_mapping: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Overwrite q and k with ``apply_qk_norm_rope_ref(...)``; returns the same (q, k) objects.
    With v, k_cache, v_cache, slot_mapping (all or none) it then also does
    ``write_kv_ref(k, v, k_cache, v_cache, slot_mapping)``, in the same launch.

    q: [T, Hq, D], k: [T, Hkv, D], one dtype of fp32/fp16/bf16, last dim contiguous (token and
    head strides free); positions: [T] int64/int32 with ``0 <= positions < P`` (not checked: it
    lives on the device); cos_cache, sin_cache: [P, D/2] floating, last dim contiguous;
    q_weight / k_weight: [D] or None (no norm for that tensor). v: [T, Hkv, D]; k_cache,
    v_cache: [NB, BS, Hkv, D]; v and the caches each fp32/fp16/bf16 with a contiguous last dim;
    slot_mapping: [T] int64/int32, -1 for a row that writes nothing.
    """
    name = "qk_norm_rope_triton"
    kv_args = (v, k_cache, v_cache, slot_mapping)
    with_kv = all(x is not None for x in kv_args)
    if not with_kv and any(x is not None for x in kv_args):
        raise ValueError(f"{name}: v, k_cache, v_cache and slot_mapping go together (all or none)")
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
                         f"[T, Hq, D] and [T, Hkv, D]")
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must share T and an "
                         f"even head_dim")
    if positions.shape != (t,) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: positions {tuple(positions.shape)} {positions.dtype} must be "
                         f"[{t}] int64 or int32")
    if (cos_cache.dim() != 2 or cos_cache.shape != sin_cache.shape
            or cos_cache.shape[1] * 2 != d):
        raise ValueError(f"{name}: cos/sin caches {tuple(cos_cache.shape)} / "
                         f"{tuple(sin_cache.shape)} must both be [P, {d // 2}]")
    if not (cos_cache.is_floating_point() and sin_cache.is_floating_point()):
        raise ValueError(f"{name}: cos/sin caches must be floating, got {cos_cache.dtype}, "
                         f"{sin_cache.dtype}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype:
        raise ValueError(f"{name}: q {q.dtype} and k {k.dtype} must share one of {_DTYPES}")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_cache.stride(1) != 1 or sin_cache.stride(1) != 1:
        raise ValueError(f"{name}: q, k, cos_cache, sin_cache need a contiguous last dim; strides "
                         f"{q.stride()}, {k.stride()}, {cos_cache.stride()}, {sin_cache.stride()}")
    if any(n > 1 and st == 0 for x in (q, k) for n, st in zip(x.shape[:2], x.stride()[:2])):
        raise ValueError(f"{name}: q and k are written in place and must not be broadcast views "
                         f"(zero strides {q.stride()}, {k.stride()})")
    for wname, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (d,) or not w.is_floating_point()):
            raise ValueError(f"{name}: {wname} {tuple(w.shape)} {w.dtype} must be [{d}] floating")
    if with_kv:
        check_kv_write_inputs(name, k, v, k_cache, v_cache, slot_mapping)
    tensors = [x for x in (q, k, positions, cos_cache, sin_cache, q_weight, k_weight) + kv_args
               if x is not None]
    check_devices(name, tensors, _INTERPRETED, "epserve.kernels.rope_triton")
    hkv = k.shape[1]
    if t == 0 or hq + hkv == 0 or d == 0:
        return q, k
    half = d // 2
    qw = q_weight.contiguous() if q_weight is not None else q
    kw = k_weight.contiguous() if k_weight is not None else k
    if with_kv:
        kv_ptrs = (v, k_cache, v_cache, slot_mapping)
        kv_strides = (v.stride(0), v.stride(1), slot_mapping.stride(0), k_cache.shape[1],
                      *k_cache.stride()[:3], *v_cache.stride()[:3])
    else:  # unused by the kernel (WRITE_KV=False): placeholders of the right kinds
        kv_ptrs = (k, k, k, positions)
        kv_strides = (0, 0, 0, 1, 0, 0, 0, 0, 0, 0)
    _qk_norm_rope_kernel[(t, hq + hkv)](
        q, k, positions, cos_cache, sin_cache, qw, kw, *kv_ptrs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), positions.stride(0),
        cos_cache.stride(0), sin_cache.stride(0), hq, half, float(eps), *kv_strides,
        HALF_P=triton.next_power_of_2(half), HAS_QW=q_weight is not None,
        HAS_KW=k_weight is not None, WRITE_KV=with_kv, num_warps=1 if half <= 64 else 2,
        enable_fp_fusion=False)  # products rounded before the add/sub, as torch's eager ops
    return q, k
