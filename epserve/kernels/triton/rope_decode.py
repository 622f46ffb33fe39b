"""Triton decode attention with its prologue in the same launch: per-head q/k RMSNorm (optional),
RoPE, and this step's K/V into the paged cache, then paged attention over the cache.

The definition is the two launches it replaces, in order: ``qk_norm_rope_triton`` with the KV
write (``rope.py``), then ``paged_decode_attention`` (``paged_attention.py``), each
equal to its torch reference. One program per (sequence s, kv head h), as the decode kernel:
it normalises and rotates k[s, h] in place and writes it and v[s, h] to slot
``slot_mapping[s]`` (a slot < 0, CUDA-graph padding, writes nothing), normalises and rotates
the GROUP query heads of h in place, then (after a block barrier, which makes its own global
writes visible to all its threads) runs the decode kernel's body on them (called inline). No other program touches
those q/k rows or that cache slot, so the launch is race free and equal to the two launches:
q, k and the caches bit for bit, the output to float rounding (products are not fused into
multiply-adds anywhere in this launch, as the rope needs; the decode kernel alone fuses them).
At batch 1 the decode kernel has only Hkv programs, so the prologue's own launch was mostly
fixed cost (bench/RESULTS.md, "Kernel tuning history").

The hybrids' gated attention (Qwen3-Next, Qwen3.5) runs the same launch with partial rotary
and zero-centred q/k norm weights (as ``qk_norm_rope_triton``) and its output gate: with
``gate`` ([S, Hq, D], e.g. a view of the q projection) the stored output is ``out *
sigmoid(gate)`` (``paged_decode_kernel``'s HAS_GATE), one launch for what was norm, rope, KV
write, attention and the gate.

Contract: a pure decode step (row s is sequence s's newest position, ``positions[s] ==
seq_lens_t[s] - 1`` and the slot is that position's; not checked: device data).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import DTYPES, check_paged_inputs, interpreted
from epserve.kernels.triton.paged_attention import decode_constexprs, paged_decode_kernel
from epserve.kernels.triton.pdl import pdl
from epserve.kernels.triton.rope import check_qk_norm_rope_args, norm_rope_rows, write_kv_rows


@triton.jit(do_not_specialize=["stride_bts"])
def _rope_decode_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr,
    kc_ptr, vc_ptr, bt_ptr, sl_ptr, o_ptr, g_ptr,
    stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pos,
    stride_cos, stride_sin, stride_slot,
    stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch,
    stride_os, stride_oh, stride_gs, stride_gh, stride_bts, HALF, TAIL, eps, scale_log2,
    window, block_size,
    HALF_P: tl.constexpr, TAIL_P: tl.constexpr, HAS_QW: tl.constexpr, HAS_KW: tl.constexpr,
    ZC: tl.constexpr, HAS_TAIL: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    WHILE_LOOP: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    s64 = s.to(tl.int64)
    h64 = kvh.to(tl.int64)
    offs = tl.arange(0, HALF_P)
    hmask = offs < HALF
    pos = tl.load(pos_ptr + s64 * stride_pos).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=hmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + offs, mask=hmask, other=0.0).to(tl.float32)[None, :]

    # k[s, kvh]: norm + rope in place, then K and V into the cache slot (one row: [1, HALF_P];
    # partial rotary: its tail of TAIL dims, [1, TAIL_P]).
    offs_t = tl.arange(0, TAIL_P)
    zero = tl.zeros([1], tl.int64)
    krow = (k_ptr + s64 * stride_ks + h64 * stride_kh + zero)[:, None]
    k1, k2, k3 = norm_rope_rows(krow + offs[None, :], kw_ptr, cos, sin, offs, hmask[None, :],
                                eps, HALF, HAS_KW, krow + 2 * HALF + offs_t[None, :], offs_t,
                                (offs_t < TAIL)[None, :], TAIL, ZC, HAS_TAIL)
    slot = tl.load(slot_ptr + s64 * stride_slot + zero).to(tl.int64)  # [1]
    write_kv_rows(k1, k2, v_ptr + s64 * stride_vs + h64 * stride_vh + zero, slot, h64, kc_ptr,
                  vc_ptr, offs, HALF, block_size, stride_kcb, stride_kco, stride_kch,
                  stride_vcb, stride_vco, stride_vch, k3, offs_t, TAIL, HAS_TAIL)

    # The GROUP query heads of kvh: norm + rope in place.
    offs_g = tl.arange(0, GROUP_P)
    heads = (kvh * GROUP + offs_g).to(tl.int64)
    q_live = offs[None, :] < tl.where(offs_g < GROUP, HALF, 0)[:, None]
    qrow = (q_ptr + s64 * stride_qs + heads * stride_qh)[:, None]
    norm_rope_rows(qrow + offs[None, :], qw_ptr, cos, sin, offs, q_live, eps, HALF, HAS_QW,
                   qrow + 2 * HALF + offs_t[None, :], offs_t,
                   offs_t[None, :] < tl.where(offs_g < GROUP, TAIL, 0)[:, None], TAIL, ZC,
                   HAS_TAIL)

    tl.debug_barrier()  # this program's q and cache writes, visible to all of its threads
    paged_decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, sl_ptr, o_ptr, g_ptr,
                        stride_qs, stride_qh, stride_os, stride_oh, stride_gs, stride_gh,
                        stride_bts, stride_kcb, stride_kco, stride_kch, scale_log2, window,
                        block_size, GROUP, GROUP_P, D, D_P, BLOCK_N, HAS_WINDOW, PRECISION,
                        WHILE_LOOP, HAS_GATE, False)  # (this kernel waited on entry)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
INTERPRETED = interpreted(_rope_decode_kernel)


def rope_paged_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             positions: torch.Tensor, cos_cache: torch.Tensor,
                             sin_cache: torch.Tensor, q_weight: torch.Tensor | None,
                             k_weight: torch.Tensor | None, eps: float,
                             k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens_t: torch.Tensor, scale: float,
                             sliding_window: int | None = None,
                             block_n: int | None = None, *, zero_centred: bool = False,
                             gate: torch.Tensor | None = None) -> torch.Tensor:
    """``qk_norm_rope_triton(q, k, ..., v=v, k_cache=..., v_cache=..., slot_mapping=...,
    zero_centred=...)`` then ``paged_decode_attention(q, k_cache, v_cache, block_tables,
    seq_lens_t, scale, sliding_window)`` (times ``sigmoid(gate)`` with a gate), in one launch.
    Arguments as those two (q and k are overwritten in place, as there; partial rotary with a
    narrower cos/sin cache); k_cache / v_cache must be contiguous and of q's dtype; gate:
    [S, Hq, D] (fp32/fp16/bf16, last dim contiguous) or None. Returns [S, Hq, D] in q.dtype."""
    name = "rope_paged_decode_triton"
    check_qk_norm_rope_args(name, q, k, positions, cos_cache, sin_cache, q_weight, k_weight,
                            (v, k_cache, v_cache, slot_mapping))
    s, hq, d, bs, hkv = check_paged_inputs(name, q, k_cache, v_cache, block_tables)
    if block_tables.shape[0] != s or seq_lens_t.shape != (s,) or seq_lens_t.dtype != torch.int32:
        raise ValueError(f"{name}: block_tables {tuple(block_tables.shape)} and seq_lens_t "
                         f"{tuple(seq_lens_t.shape)} {seq_lens_t.dtype} need one row per "
                         f"sequence ({s}), seq_lens_t int32")
    if k.shape[1] != hkv or seq_lens_t.device != q.device or block_tables.device != q.device:
        raise ValueError(f"{name}: k has {k.shape[1]} heads, the cache {hkv}; block_tables and "
                         f"seq_lens_t must be on {q.device}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{name}: sliding_window {sliding_window!r} must be None or a positive int")
    if gate is not None and (gate.shape != q.shape or gate.dtype not in DTYPES
                             or gate.stride(2) != 1 or gate.device != q.device):
        raise ValueError(f"{name}: gate {tuple(gate.shape)} {gate.dtype} must be "
                         f"{tuple(q.shape)} in {DTYPES} on {q.device}, last dim contiguous")
    consts = decode_constexprs(q, hkv, sliding_window, block_n, name)
    consts["HAS_GATE"] = gate is not None
    out = torch.empty((s, hq, d), dtype=q.dtype, device=q.device)
    if s == 0:
        return out
    half = cos_cache.shape[1]
    tail = d - 2 * half
    g = gate if gate is not None else out
    qw = q_weight.contiguous() if q_weight is not None else q
    kw = k_weight.contiguous() if k_weight is not None else k
    _rope_decode_kernel[(s, hkv)](
        q, k, v, positions, cos_cache, sin_cache, qw, kw, slot_mapping,
        k_cache, v_cache, block_tables, seq_lens_t, out, g,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        positions.stride(0), cos_cache.stride(0), sin_cache.stride(0), slot_mapping.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        g.stride(0), g.stride(1), block_tables.stride(0), half, tail, float(eps),
        float(scale) * 1.4426950408889634, int(sliding_window or 0), bs,
        HALF_P=triton.next_power_of_2(half), TAIL_P=triton.next_power_of_2(max(tail, 1)),
        HAS_QW=q_weight is not None, HAS_KW=k_weight is not None, ZC=bool(zero_centred),
        HAS_TAIL=tail > 0, **consts, num_warps=4, num_stages=2,
        enable_fp_fusion=False, **pdl(_rope_decode_kernel))
    return out
