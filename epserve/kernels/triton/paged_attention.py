"""Triton paged attention for pure decode batches (one new query row per sequence).

The definition is ``attention.paged_attention_ref``; this is a faster implementation of the case
``query_start_loc == range(S + 1)``. One program per (sequence, kv head): it loads the
``[GROUP, D]`` tile of query heads that share the kv head, walks the sequence's KV positions
``BLOCK_N`` at a time through the block table (each position looks up its own physical block,
so ``BLOCK_N`` need not relate to ``block_size``), and keeps an online softmax in float32, so
each K/V element is read once per kv head. The new row sits at position ``seq_len - 1`` and sees
every key before it (and, with a sliding window ``W``, only keys at positions ``>= seq_len - W``).
With HAS_GATE (the fused rope + decode kernel's gated attention, Qwen3-Next / Qwen3.5) each
output row is multiplied by ``sigmoid(gate)`` before it is stored, rounded as torch's
``out * torch.sigmoid(gate)`` (the output and the sigmoid each in their dtype first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import check_paged_inputs, interpreted
from epserve.kernels.triton.pdl import pdl


@triton.jit
def _decode_tile(q, k_ptr, v_ptr, bt_row, start, seq_len, lo, kvh, m_i, l_i, acc,
                 stride_kb, stride_kt, stride_kh, scale_log2, block_size, offs_n, offs_d, d_mask,
                 PRECISION: tl.constexpr):
    """One BLOCK_N tile of KV positions [start, start + BLOCK_N): online-softmax update."""
    pos = start + offs_n
    valid = (pos < seq_len) & (pos >= lo)
    blk = tl.load(bt_row + pos // block_size, mask=valid, other=0)
    kv_off = blk.to(tl.int64) * stride_kb + (pos % block_size) * stride_kt + kvh * stride_kh
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D_P]
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_P, N]
    qk = tl.where(valid[None, :], qk, float("-inf"))
    # Every tile holds at least one valid key (the first starts at or before lo, each later one
    # starts below seq_len), so m_new is finite and no NaN arises.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_bts"])  # table width varies per eager step
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, o_ptr, g_ptr,
    stride_qs, stride_qh, stride_os, stride_oh, stride_gs, stride_gh, stride_bts,
    stride_kb, stride_kt, stride_kh,
    scale_log2, window, block_size,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    WHILE_LOOP: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (sequence s, kv head kvh): its GROUP query heads against the sequence's KV,
    output rows stored. Also called inline by the fused rope + decode kernel, whose programs
    are the same (s, kvh) grid."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(sl_ptr + s)

    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, D_P)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    heads = kvh * GROUP + offs_g
    qg_mask = g_mask[:, None] & d_mask[None, :]

    q = tl.load(q_ptr + s * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=qg_mask, other=0.0)  # [GROUP_P, D_P]

    lo = seq_len * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    start0 = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, D_P], tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * stride_bts
    if WHILE_LOOP:
        # TRITON_INTERPRET with numpy >= 2.4 cannot use a loaded scalar as a range() bound.
        start = start0
        while start < seq_len:
            m_i, l_i, acc = _decode_tile(
                q, k_ptr, v_ptr, bt_row, start, seq_len, lo, kvh, m_i, l_i, acc,
                stride_kb, stride_kt, stride_kh, scale_log2, block_size, offs_n, offs_d, d_mask,
                PRECISION)
            start += BLOCK_N
    else:
        for start in range(start0, seq_len, BLOCK_N):
            m_i, l_i, acc = _decode_tile(
                q, k_ptr, v_ptr, bt_row, start, seq_len, lo, kvh, m_i, l_i, acc,
                stride_kb, stride_kt, stride_kh, scale_log2, block_size, offs_n, offs_d, d_mask,
                PRECISION)

    out = acc / l_i[:, None]
    if HAS_GATE:  # out * sigmoid(gate), each rounded to its dtype first (torch's order)
        gate = tl.load(g_ptr + s * stride_gs + heads[:, None] * stride_gh + offs_d[None, :],
                       mask=qg_mask, other=0.0)
        sig = tl.sigmoid(gate.to(tl.float32)).to(gate.dtype).to(tl.float32)
        out = out.to(o_ptr.dtype.element_ty).to(tl.float32) * sig
    tl.store(o_ptr + s * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=qg_mask)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported; the
# interpreter (numpy >= 2.4) needs the while-loop form of the KV loop.
INTERPRETED = interpreted(_paged_decode_kernel)

#: The decode program, for the fused rope + decode kernel (``rope_decode.py``), which runs it
#: inline on its own (s, kvh) grid; launched here under its own name (the one profiles show).
paged_decode_kernel = _paged_decode_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens_t: torch.Tensor, scale: float,
                           sliding_window: int | None = None,
                           block_n: int | None = None) -> torch.Tensor:
    """Decode attention: row s of q is the last of sequence s's ``seq_lens_t[s]`` KV positions.

    q: [S, Hq, D] (last dim contiguous); k_cache, v_cache: [NB, BS, Hkv, D] contiguous, same
    dtype as q (fp16, bf16 or fp32); block_tables: [S, max_blocks] int32; seq_lens_t: [S] int32
    with ``1 <= seq_lens_t[s] <= max_blocks * BS`` (not checked: it lives on the device).
    Returns [S, Hq, D] in q.dtype, equal to ``paged_attention_ref`` on a pure decode batch.
    """
    s, hq, d, bs, hkv = check_paged_inputs("paged_decode_attention", q, k_cache, v_cache,
                                           block_tables)
    if block_tables.shape[0] != s:
        raise ValueError(f"paged_decode_attention: block_tables {tuple(block_tables.shape)} "
                         f"must have one row per sequence ({s})")
    if seq_lens_t.shape != (s,) or seq_lens_t.dtype != torch.int32:
        raise ValueError(f"paged_decode_attention: seq_lens_t {tuple(seq_lens_t.shape)} "
                         f"{seq_lens_t.dtype} must be [{s}] int32")
    devs = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens_t)}
    if len(devs) != 1:
        raise ValueError(f"paged_decode_attention: tensors on several devices {sorted(map(str, devs))}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"paged_decode_attention: sliding_window {sliding_window!r} must be "
                         f"None or a positive int")
    consts = decode_constexprs(q, hkv, sliding_window, block_n, "paged_decode_attention")
    out = torch.empty((s, hq, d), dtype=q.dtype, device=q.device)
    if s == 0:
        return out
    _paged_decode_kernel[(s, hkv)](
        q, k_cache, v_cache, block_tables, seq_lens_t, out, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), 0, 0, block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        float(scale) * 1.4426950408889634, int(sliding_window or 0), bs,
        **consts, num_warps=4, num_stages=2, **pdl(_paged_decode_kernel))
    return out


def decode_constexprs(q: torch.Tensor, num_kv_heads: int, sliding_window: int | None,
                      block_n: int | None, name: str) -> dict:
    """The compile-time arguments of ``_paged_decode_kernel`` for q: [S, Hq, D] (checks block_n)."""
    if block_n is None:
        block_n = 64 if q.is_cuda else 16
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{name}: block_n {block_n} must be a power of two >= 16")
    group, d = q.shape[1] // num_kv_heads, q.shape[2]
    # tl.dot needs every tile dim >= 16; padded rows/cols are masked.
    return dict(GROUP=group, GROUP_P=max(16, _next_pow2(group)), D=d, D_P=max(16, _next_pow2(d)),
                BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                WHILE_LOOP=INTERPRETED, HAS_GATE=False)
