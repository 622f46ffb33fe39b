"""Group a step's routed (token, k) pairs by local expert: the layout the fused MoE GEMMs read.

Pairs are flat indices ``p = t * K + k`` into ``topk_ids`` [T, K]. The layout lists each local
expert's pairs (ascending, so stable) padded to a multiple of ``block_m`` with the sentinel
``T * K``, experts in order; ``block_expert[b]`` is the local expert of block b. Pairs routed
outside ``[expert_offset, expert_offset + E)`` are dropped (another rank owns them).

``moe_align_ref`` (torch) is the definition and returns exactly that layout (its size depends on
the routing, so it syncs with the host). ``moe_align`` (Triton, two launches) returns the same
layout inside buffers whose size depends only on (T, K, E, block_m) — the blocks after the layout
hold sentinels and expert -1 (no work) — and never syncs with the host, so a CUDA graph can
capture it. It splits the pairs into chunks, a program each: the first launch counts each
chunk's pairs per expert, the second gives every program all the counts (a few KiB) so it can
place its chunk's pairs, and fill its share of the blocks, without waiting for any other (one
program walking the pairs serially was a fifth of a 256-row decode step's MoE layer:
bench/RESULTS.md, session 25). ``moe_align_torch`` returns the same static layout
from a few torch ops (a stable sort) and also never syncs: the choice for many pairs (prefill).
The bound: experts with pairs number at most min(E, T*K), and each wastes fewer than
``block_m`` slots, so the layout fits ``T*K + min(E, T*K) * (block_m - 1)`` slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.triton.pdl import pdl


def moe_align_ref(topk_ids: torch.Tensor, num_local_experts: int, expert_offset: int,
                  block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact layout: ``(sorted_ids [P] int32, block_expert [P // block_m] int32)``."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64) - expert_offset
    sentinel = flat.numel()
    is_local = (flat >= 0) & (flat < num_local_experts)
    pair_idx = torch.nonzero(is_local).reshape(-1)  # [n], ascending
    local_e = flat[pair_idx]
    order = torch.argsort(local_e, stable=True)
    sorted_pairs, sorted_e = pair_idx[order], local_e[order]
    counts = torch.bincount(local_e, minlength=num_local_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(sorted_pairs.numel(), device=device)
    pos = padded_start[sorted_e] + (rank - start[sorted_e])
    sorted_ids = torch.full((int(padded.sum().item()),), sentinel, dtype=torch.int32, device=device)
    sorted_ids[pos] = sorted_pairs.to(torch.int32)
    block_expert = torch.repeat_interleave(
        torch.arange(num_local_experts, dtype=torch.int32, device=device), padded // block_m)
    return sorted_ids, block_expert


def max_aligned_blocks(num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """Blocks ``moe_align`` allocates for ``num_pairs`` pairs (the static bound above)."""
    worst = num_pairs + min(num_local_experts, num_pairs) * (block_m - 1)
    return -(-worst // block_m)


@triton.jit
def _expert_hits(ids_ptr, offs, n, expert_offset, num_local, experts):
    """[CHUNK, E_P] int32 one-hot of each pair's local expert (all zero for other ranks')."""
    inb = offs < n
    e = tl.load(ids_ptr + offs, mask=inb, other=0).to(tl.int32) - expert_offset
    valid = inb & (e >= 0) & (e < num_local)
    return ((e[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32), valid


@triton.jit(do_not_specialize=["n"])  # varies with T: one compile
def _align_count_kernel(ids_ptr, counts_ptr, n, num_local, expert_offset, E_P: tl.constexpr,
                        CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program c: how many of pairs [c * CHUNK, (c + 1) * CHUNK) each local expert has."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    c = tl.program_id(0)
    experts = tl.arange(0, E_P)
    hit, _ = _expert_hits(ids_ptr, c * CHUNK + tl.arange(0, CHUNK), n, expert_offset, num_local,
                          experts)
    tl.store(counts_ptr + c * E_P + experts, tl.sum(hit, axis=0))


@triton.jit(do_not_specialize=["n", "num_chunks", "num_blocks"])  # vary with T: one compile
def _align_place_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, n, num_chunks,
                        num_local, expert_offset, num_blocks, BLOCK_M: tl.constexpr,
                        E_P: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program c: every expert's place from all chunks' counts (each program sums them again:
    a few KiB), then chunk c's pairs to their slots, and its share of the blocks: each block's
    expert, a sentinel in each slot no pair takes. Pairs and sentinels go to disjoint slots,
    so no program waits for another. Loops are while-loops over runtime bounds (the
    interpreter cannot ``range`` over them)."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    me = tl.program_id(0)
    experts = tl.arange(0, E_P)
    lane = tl.arange(0, CHUNK)
    total = tl.zeros([E_P], tl.int32)
    before = tl.zeros([E_P], tl.int32)  # pairs of each expert in the chunks before this one
    r = 0
    while r < num_chunks:
        ch = r + lane
        cnt = tl.load(counts_ptr + ch[:, None] * E_P + experts[None, :],
                      mask=(ch < num_chunks)[:, None], other=0)
        total += tl.sum(cnt, axis=0)
        before += tl.sum(tl.where((ch < me)[:, None], cnt, 0), axis=0)
        r += CHUNK
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    offs = me * CHUNK + lane
    hit, valid = _expert_hits(ids_ptr, offs, n, expert_offset, num_local, experts)
    rank = tl.cumsum(hit, axis=0) - 1  # [CHUNK, E_P]: earlier pairs of the chunk, same expert
    pos = tl.sum(hit * (rank + (start + before)[None, :]), axis=1)
    tl.store(sorted_ptr + pos, offs, mask=valid)
    per = (num_blocks + tl.num_programs(0) - 1) // tl.num_programs(0)
    b_lo = me * per
    b_hi = tl.minimum(b_lo + per, num_blocks)
    b = b_lo
    while b < b_hi:
        blk = b + lane
        row = blk * BLOCK_M
        inside = (row[:, None] >= start[None, :]) & (row[:, None] < end[None, :])
        ex = tl.sum(tl.where(inside, experts[None, :], 0), axis=1)
        owned = tl.sum(inside.to(tl.int32), axis=1) > 0
        tl.store(block_expert_ptr + blk, tl.where(owned, ex, -1), mask=blk < b_hi)
        b += CHUNK
    s = b_lo * BLOCK_M
    while s < b_hi * BLOCK_M:
        slot = s + lane
        taken = (slot[:, None] >= start[None, :]) & (slot[:, None] < (start + total)[None, :])
        pad = tl.sum(taken.to(tl.int32), axis=1) == 0
        tl.store(sorted_ptr + slot, tl.zeros([CHUNK], tl.int32) + n,
                 mask=pad & (slot < b_hi * BLOCK_M))
        s += CHUNK


def _check_align_args(topk_ids: torch.Tensor, num_local_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align: topk_ids must be [T, K] int32/int64, got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if num_local_experts < 1 or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"moe_align: need num_local_experts >= 1 and block_m a power of two, "
                         f"got {num_local_experts}, {block_m}")


def moe_align_torch(topk_ids: torch.Tensor, num_local_experts: int, expert_offset: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align``'s static layout from torch ops, without a host sync (same contract).

    Pairs of other ranks sort after every local one (bin E) and are scattered to one spare
    slot past the layout, which is cut off.
    """
    _check_align_args(topk_ids, num_local_experts, block_m)
    e, bm = num_local_experts, block_m
    flat = topk_ids.reshape(-1).to(torch.int64) - expert_offset
    n, device = flat.numel(), flat.device
    nb = max_aligned_blocks(n, e, bm)
    key = torch.where((flat >= 0) & (flat < e), flat, e)  # [n] local expert, or bin E
    counts = torch.zeros(e + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:e] + bm - 1) // bm * bm
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts  # [E + 1] first sorted rank of each bin
    order = torch.argsort(key, stable=True)  # pair ids by expert, ascending within one
    sorted_key = key[order]
    rank = torch.arange(n, device=device) - start[sorted_key]
    local = sorted_key < e
    slot_start = (padded_end - padded)[sorted_key.clamp(max=e - 1)]
    pos = torch.where(local, slot_start + rank, nb * bm)  # others -> the spare slot
    sorted_ids = torch.full((nb * bm + 1,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    rows = torch.arange(nb, device=device) * bm
    owner = torch.searchsorted(padded_end, rows, right=True)  # first expert ending past row
    block_expert = torch.where(owner < e, owner, -1).to(torch.int32)
    return sorted_ids[:nb * bm], block_expert


def moe_align(topk_ids: torch.Tensor, num_local_experts: int, expert_offset: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align_ref``'s layout in static-size buffers, without a host sync.

    topk_ids: [T, K] int32/int64 global ids. Returns ``(sorted_ids [NB * block_m] int32,
    block_expert [NB] int32)`` with ``NB = max_aligned_blocks(T * K, E, block_m)``: the first
    blocks are the reference layout, the rest hold the sentinel ``T * K`` and expert -1.
    """
    _check_align_args(topk_ids, num_local_experts, block_m)
    ids = topk_ids.reshape(-1).contiguous()
    n = ids.numel()
    nb = max_aligned_blocks(n, num_local_experts, block_m)
    sorted_ids = torch.empty(nb * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=ids.device)
    if nb == 0:
        return sorted_ids, block_expert
    e_p = triton.next_power_of_2(num_local_experts)
    chunk = max(16, min(256, 8192 // e_p))
    num_chunks = triton.cdiv(n, chunk)
    counts = torch.empty((num_chunks, e_p), dtype=torch.int32, device=ids.device)
    _align_count_kernel[(num_chunks,)](ids, counts, n, num_local_experts, expert_offset, E_P=e_p,
                                       CHUNK=chunk, num_warps=4, **pdl(_align_count_kernel))
    _align_place_kernel[(num_chunks,)](ids, counts, sorted_ids, block_expert, n, num_chunks,
                                       num_local_experts, expert_offset, nb, BLOCK_M=block_m,
                                       E_P=e_p, CHUNK=chunk, num_warps=4,
                                       **pdl(_align_place_kernel))
    return sorted_ids, block_expert
