"""Triton paged attention for prefill, chunked-prefill and mixed batches (any rows per sequence).

The definition is ``attention.paged_attention_ref``: sequence s owns rows ``[qsl[s], qsl[s+1])``
at positions ``seq_len - n_s .. seq_len - 1`` (its K/V already in the cache); each row sees the
keys at positions ``<= its own`` (and, with a sliding window ``W``, ``> its own - W``); float32
online softmax; output in q.dtype; rows outside ``[qsl[0], qsl[-1])`` are zero.

Work is cut into query tiles of ``TOK`` consecutive rows of one sequence. One program per
(tile, kv head) loads the tile's rows for every query head of that kv head's GQA group, folded
into one ``[TOK * GROUP_P, D]`` operand (``BLOCK_M = TOK * GROUP_P`` matrix rows), so each K/V
tile is read once per kv head. It walks KV positions ``BLOCK_N`` at a time through the block
table (each position looks up its own physical block), in three phases: masked tiles at the
window's lower edge, unmasked tiles every row sees whole, masked tiles on the causal diagonal;
nothing past the tile's last row is read. The host describes tiles in a small int32 map
(``build_tile_map``: first row, row count, first position, sequence) built once per step.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import check_paged_inputs, interpreted
from epserve.kernels.triton.pdl import pdl

_MAP_COLS = 4  # row_start, n_rows, pos0, seq


@triton.jit
def _kv_tile(q, k_ptr, v_ptr, bt_row, start, end, q_pos, kvh, window, m_i, l_i, acc,
             stride_kb, stride_kt, stride_kh, scale_log2, block_size, offs_n, offs_d, d_mask,
             MASK: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """Keys at positions [start, start + BLOCK_N): online-softmax update of the folded rows."""
    pos = start + offs_n
    if MASK:
        valid = pos < end
        blk = tl.load(bt_row + pos // block_size, mask=valid, other=0)
        kv_mask = valid[:, None] & d_mask[None, :]
    else:  # every position is below ``end``
        blk = tl.load(bt_row + pos // block_size)
        kv_mask = d_mask[None, :]
    kv_off = blk.to(tl.int64) * stride_kb + (pos % block_size) * stride_kt + kvh * stride_kh
    k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D_P]
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, N]
    if MASK:
        seen = pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _kv_phase(q, k_ptr, v_ptr, bt_row, lo, hi, end, q_pos, kvh, window, m_i, l_i, acc,
              stride_kb, stride_kt, stride_kh, scale_log2, block_size, offs_n, offs_d, d_mask,
              BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
              PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr):
    """KV tiles starting at lo, lo + BLOCK_N, ... below hi (both multiples of BLOCK_N)."""
    if WHILE_LOOP:
        # TRITON_INTERPRET with numpy >= 2.4 cannot use a loaded scalar as a range() bound.
        start = lo
        while start < hi:
            m_i, l_i, acc = _kv_tile(q, k_ptr, v_ptr, bt_row, start, end, q_pos, kvh, window,
                                     m_i, l_i, acc, stride_kb, stride_kt, stride_kh, scale_log2,
                                     block_size, offs_n, offs_d, d_mask, MASK, HAS_WINDOW,
                                     PRECISION)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _kv_tile(q, k_ptr, v_ptr, bt_row, start, end, q_pos, kvh, window,
                                     m_i, l_i, acc, stride_kb, stride_kt, stride_kh, scale_log2,
                                     block_size, offs_n, offs_d, d_mask, MASK, HAS_WINDOW,
                                     PRECISION)
    return m_i, l_i, acc


# The block-table width varies per step: no divisibility specialization (one compile, not one
# per width class met mid-run).
@triton.jit(do_not_specialize=["stride_bts"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, map_ptr, o_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bts,
    stride_kb, stride_kt, stride_kh,
    scale_log2, window, block_size, num_kv_heads,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr,
    D_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    tile = pid // num_kv_heads
    kvh = pid % num_kv_heads
    row_start = tl.load(map_ptr + tile * 4)
    n_rows = tl.load(map_ptr + tile * 4 + 1)
    p_min = tl.load(map_ptr + tile * 4 + 2)
    seq = tl.load(map_ptr + tile * 4 + 3)
    p_max = p_min + n_rows - 1
    end = p_max + 1

    # Folded row r: token r // GROUP_P of the tile, query head kvh * GROUP + r % GROUP_P.
    offs_r = tl.arange(0, TOK * GROUP_P)
    offs_d = tl.arange(0, D_P)
    offs_n = tl.arange(0, BLOCK_N)
    tok = offs_r // GROUP_P
    g = offs_r % GROUP_P
    d_mask = offs_d < D
    r_mask = (tok < n_rows) & (g < GROUP)
    rows = (row_start + tok).to(tl.int64)
    heads = kvh * GROUP + g
    io_mask = r_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)  # [BLOCK_M, D_P]
    q_pos = p_min + tl.minimum(tok, n_rows - 1)  # padded rows act as the last real one

    # Phase bounds, multiples of BLOCK_N: [b0, b1) window edge (masked), [b1, b2) seen whole by
    # every row, [b2, b3) causal diagonal (masked).
    k_lo = p_min * 0
    full_lo = p_min * 0
    if HAS_WINDOW:
        k_lo = tl.maximum(p_min - window + 1, 0)
        full_lo = tl.maximum(p_max - window + 1, 0)
    b0 = (k_lo // BLOCK_N) * BLOCK_N
    b3 = ((end + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    b1 = tl.minimum(((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, b3)
    b2 = tl.maximum(((p_min + 1) // BLOCK_N) * BLOCK_N, b1)

    m_i = tl.full([TOK * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([TOK * GROUP_P], tl.float32)
    acc = tl.zeros([TOK * GROUP_P, D_P], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    if HAS_WINDOW:
        m_i, l_i, acc = _kv_phase(q, k_ptr, v_ptr, bt_row, b0, b1, end, q_pos, kvh, window,
                                  m_i, l_i, acc, stride_kb, stride_kt, stride_kh, scale_log2,
                                  block_size, offs_n, offs_d, d_mask, BLOCK_N, True, HAS_WINDOW,
                                  PRECISION, WHILE_LOOP)
    m_i, l_i, acc = _kv_phase(q, k_ptr, v_ptr, bt_row, b1, b2, end, q_pos, kvh, window,
                              m_i, l_i, acc, stride_kb, stride_kt, stride_kh, scale_log2,
                              block_size, offs_n, offs_d, d_mask, BLOCK_N, False, HAS_WINDOW,
                              PRECISION, WHILE_LOOP)
    m_i, l_i, acc = _kv_phase(q, k_ptr, v_ptr, bt_row, b2, b3, end, q_pos, kvh, window,
                              m_i, l_i, acc, stride_kb, stride_kt, stride_kh, scale_log2,
                              block_size, offs_n, offs_d, d_mask, BLOCK_N, True, HAS_WINDOW,
                              PRECISION, WHILE_LOOP)

    # Each real row has seen at least its own position, so l_i > 0 where stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=io_mask)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported; the
# interpreter (numpy >= 2.4) needs the while-loop form of the KV loops.
INTERPRETED = interpreted(_paged_prefill_kernel)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def tokens_per_tile(num_q_heads: int, num_kv_heads: int, block_m: int) -> int:
    """Query rows (tokens) per tile so that a tile folds into ``block_m`` matrix rows
    (``block_m`` a power of two >= 16; at least one token when the group is larger)."""
    return max(1, block_m // _next_pow2(num_q_heads // num_kv_heads))


def default_block_m(device: torch.device) -> int:
    """Folded matrix rows per program: 128 on CUDA, 32 in the interpreter (small tests)."""
    return 128 if device.type == "cuda" else 32


@dataclass(frozen=True)
class TileMap:
    """Query tiles of one step: ``tiles`` [num_tiles, 4] int32 on the device, each (first row,
    rows, first position, sequence), at most ``tok`` rows; rows outside ``[row_lo, row_hi)``
    belong to no sequence."""

    tiles: torch.Tensor
    tok: int
    row_lo: int
    row_hi: int


def build_tile_map(query_start_loc, seq_lens, tok: int, device: torch.device) -> TileMap:
    """Tiles of ``tok`` (a power of two) rows over each sequence's rows, on ``device``.

    Inputs are trusted to satisfy the contract (``0 <= n_s <= seq_len``, qsl non-decreasing);
    sequences with no rows have no tile. Tiles are ordered by KV positions walked, longest
    first, so the longest programs start first. CUDA: pinned buffer, non-blocking copy.
    """
    if tok < 1 or tok & (tok - 1):
        raise ValueError(f"build_tile_map: tok {tok} must be a power of two")
    tiles = []
    for s, seq_len in enumerate(seq_lens):
        start, n = query_start_loc[s], query_start_loc[s + 1] - query_start_loc[s]
        base = seq_len - n
        for m0 in range(0, n, tok):
            rows = min(tok, n - m0)
            tiles.append((base + m0 + rows, start + m0, rows, base + m0, s))
    tiles.sort(key=lambda x: -x[0])
    flat = array.array("i", [x for t in tiles for x in t[1:]])
    host = torch.frombuffer(flat, dtype=torch.int32) if tiles else torch.empty(0, dtype=torch.int32)
    host = host.view(-1, _MAP_COLS)
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.clone().to(device)
    return TileMap(dev, tok, query_start_loc[0], query_start_loc[-1])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, tile_map: TileMap, scale: float,
                            sliding_window: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None,
                            num_stages: int | None = None) -> torch.Tensor:
    """Attention of a flat batch of ragged sequences over the paged KV cache.

    q: [T, Hq, D] (last dim contiguous); k_cache, v_cache: [NB, BS, Hkv, D] contiguous, same
    dtype as q (fp16, bf16 or fp32), Hq a multiple of Hkv; block_tables: [S, max_blocks] int32;
    tile_map: ``build_tile_map(qsl, seq_lens, tok, q.device)`` with ``tok * next_pow2(Hq/Hkv)``
    >= 16 (``tokens_per_tile`` gives one); its device entries are trusted, not checked, as is
    ``seq_lens[s] <= max_blocks * BS``. Returns [T, Hq, D] in q.dtype, equal to
    ``paged_attention_ref``; rows outside ``[row_lo, row_hi)`` are zero. The knobs are tuning.
    """
    name = "paged_prefill_attention"
    t, hq, d, bs, hkv = check_paged_inputs(name, q, k_cache, v_cache, block_tables)
    tiles = tile_map.tiles
    if tiles.dim() != 2 or tiles.shape[1] != _MAP_COLS or tiles.dtype != torch.int32:
        raise ValueError(f"{name}: tile_map.tiles {tuple(tiles.shape)} {tiles.dtype} must be "
                         f"[num_tiles, {_MAP_COLS}] int32 from build_tile_map")
    if not 0 <= tile_map.row_lo <= tile_map.row_hi <= t:
        raise ValueError(f"{name}: rows [{tile_map.row_lo}, {tile_map.row_hi}) not inside the "
                         f"batch's {t} rows")
    devs = {x.device for x in (q, k_cache, v_cache, block_tables, tiles)}
    if len(devs) != 1:
        raise ValueError(f"{name}: tensors on several devices {sorted(map(str, devs))}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{name}: sliding_window {sliding_window!r} must be None or a "
                         f"positive int")
    group = hq // hkv
    group_p = _next_pow2(group)
    block_m = tile_map.tok * group_p
    if block_m < 16 or tile_map.tok & (tile_map.tok - 1):
        raise ValueError(f"{name}: tile_map.tok {tile_map.tok} must be a power of two with "
                         f"tok * {group_p} (padded GQA group) >= 16")
    if block_n is None:
        block_n = (32 if q.dtype == torch.float32 else 64) if q.is_cuda else 16
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{name}: block_n {block_n} must be a power of two >= 16")

    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if tile_map.row_lo > 0:
        out[:tile_map.row_lo].zero_()
    if tile_map.row_hi < t:
        out[tile_map.row_hi:].zero_()
    if tiles.shape[0] == 0:
        return out
    d_p = max(16, _next_pow2(d))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_prefill_kernel[(tiles.shape[0] * hkv,)](
        q, k_cache, v_cache, block_tables, tiles, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        float(scale) * 1.4426950408889634, int(sliding_window or 0), bs, hkv,
        GROUP=group, GROUP_P=group_p, TOK=tile_map.tok, D=d, D_P=d_p, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, PRECISION=precision, WHILE_LOOP=INTERPRETED,
        num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=num_stages or 2,
        **pdl(_paged_prefill_kernel))
    return out
