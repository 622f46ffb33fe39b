"""Triton fused MoE: align routed pairs by local expert, two grouped GEMMs, combine in float32.

Same contract as ``epserve.kernels.moe.fused_moe_ref`` (the definition):
x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_ids [T, K] GLOBAL expert
ids; topk_weights [T, K]; ids outside ``[expert_offset, expert_offset + E)`` contribute zero.

Pipeline: ``moe_align`` (moe_align.py) sorts the flat (token, k) pairs ``p = t * K + k`` by local expert and pads
each expert's group to a multiple of ``block_m`` with the sentinel ``T * K``; GEMM 1 gathers rows
``x[p // K]`` and writes ``silu(gate) * up`` ([P, I], x.dtype, in sorted order); GEMM 2 reads that
intermediate, multiplies by the routing weight and scatters rows in x.dtype to ``y[p]`` (each pair's
weighted output rounded once, as the final cast would; half the bytes of float32 rows); the combine
sums each token's local pairs of ``y`` (one launch, also the cast). ``fused_moe_pairs_triton`` stops
before the combine (``combine_pairs_triton`` is it alone), and ``combine_pairs_block`` is its sum
for another kernel's epilogue (the shared expert's down GEMV at one row, ``shared_expert.py``).
Importing this module imports triton; kernels decorated while ``TRITON_INTERPRET=1`` is set run
in the Triton interpreter (CPU tensors allowed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import DTYPES
from epserve.kernels.triton.moe_align import moe_align, moe_align_torch
from epserve.kernels.triton.pdl import pdl

#: Up to this many (token, k) pairs the layout comes from the Triton ``moe_align`` (a program
#: per chunk of pairs, two launches: decode steps, which CUDA graphs capture, stay far below
#: it). Above it (prefill chunks) ``moe_align_torch`` builds the same static layout with a
#: stable sort. Neither syncs with the host (the reference's data-sized layout cost one sync
#: per layer).
ALIGN_IN_KERNEL_MAX_PAIRS = 4096

#: Up to this many pairs (batch 1-2 decode at top-8) there is no layout at all: each pair is
#: its own block (one valid row), its expert read from ``topk_ids`` by the GEMMs. Saves the
#: ``moe_align`` launch; pairs that share an expert read its weights once each (rare here).
PAIR_BLOCKS_MAX_PAIRS = 16


@triton.jit(do_not_specialize=["num_slots"])  # T * K varies per step: one compile
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ids_ptr, block_expert_ptr,
                     num_slots, top_k, up_offset, expert_offset, num_local,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                     N: tl.constexpr, KD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     A_BY_PAIR: tl.constexpr, C_BY_PAIR: tl.constexpr, FUSE_SILU: tl.constexpr,
                     MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
                     PAIR_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of ``A[rows] @ B[e]^T`` for a block of one expert's pairs.

    Rows of A: ``pair // top_k`` (A_BY_PAIR, i.e. x) or the sorted position (the intermediate).
    FUSE_SILU: also computes the tile at rows ``up_offset + n`` of B[e] and stores
    ``silu(gate) * up``. MUL_WEIGHT: scales row by ``w[pair]``. Rows of C: ``pair`` (C_BY_PAIR)
    or the sorted position. Sentinel pairs (``>= num_slots``) load zeros and are not stored.
    PAIR_BLOCKS (a few pairs, no layout): block b is pair b alone, its expert read from the
    flat ``topk_ids`` (``block_expert_ptr``); its other rows are sentinels.
    N and KD (the layer's H / I) are compile-time constants: one compile per layer shape, and
    the interpreter (numpy 2.x) cannot loop over a runtime bound.
    """
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64) - expert_offset
        if (e < 0) | (e >= num_local):
            return
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_slots).to(tl.int64)
    else:
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        if e < 0:
            return
        pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    valid = pair < num_slots
    if A_BY_PAIR:
        a_rows = pair // top_k
    else:
        a_rows = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = (b_ptr + e * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
              + offs_k[:, None] * stride_bk)  # [BLOCK_K, BLOCK_N] view of B[e]^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KD, BLOCK_K):
        k_mask = offs_k < KD - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if FUSE_SILU:
            b_up = tl.load(b_ptrs + up_offset * stride_bn, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if FUSE_SILU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        wt = tl.load(w_ptr + pair, mask=valid, other=0.0)
        acc = acc * wt[:, None]
    if C_BY_PAIR:
        c_rows = pair
    else:
        c_rows = offs_m.to(tl.int64)
    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def combine_pairs_block(y_ptr, ids_ptr, t, cols, h, num_local, expert_offset,
                        TOP_K: tl.constexpr):
    """Token ``t``'s routed output at ``cols`` (a block of column indices; those ``>= h`` read
    nothing): ``sum over k of y[t * K + k, cols]`` for the pairs routed to a local expert (the
    other rows are never read: they may hold anything), in float32, k ascending. Returns the
    float32 block, unrounded; y is [T * K, h] contiguous, ids [T, K]."""
    acc = tl.zeros(cols.shape, tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + k).to(tl.int64) - expert_offset
        # a non-local pair reads nothing (the bound, not a scalar bool mask: newer interpreters)
        lim = tl.where((e >= 0) & (e < num_local), h, 0)
        acc += tl.load(y_ptr + (t * TOP_K + k) * h + cols, mask=cols < lim, other=0.0)
    return acc


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, h, num_local, expert_offset,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[t, cols] = ``combine_pairs_block`` of token t, stored in out's dtype."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = combine_pairs_block(y_ptr, ids_ptr, t, cols, h, num_local, expert_offset, TOP_K)
    tl.store(out_ptr + t * h + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < h)


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes and launch shape of the two GEMMs (block sizes are powers of two >= 16).
    ``block_m`` is shared (it is the alignment of each expert's group); the rest is per GEMM."""

    block_m: int
    block_n1: int = 64
    block_k1: int = 64
    warps1: int = 4
    stages1: int = 3
    block_n2: int = 64
    block_k2: int = 64
    warps2: int = 4
    stages2: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n1", "block_k1", "block_n2", "block_k2"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"fused_moe_triton: {name} must be a power of two >= 16, got {v}")
        for name in ("warps1", "warps2"):
            v = getattr(self, name)
            if v not in (1, 2, 4, 8, 16):
                raise ValueError(f"fused_moe_triton: {name} must be 1, 2, 4, 8 or 16, got {v}")
        for name in ("stages1", "stages2"):
            if getattr(self, name) < 1:
                raise ValueError(f"fused_moe_triton: {name} must be >= 1, got {getattr(self, name)}")

    def describe(self) -> str:
        return (f"m{self.block_m} | n{self.block_n1} k{self.block_k1} w{self.warps1} "
                f"s{self.stages1} | n{self.block_n2} k{self.block_k2} w{self.warps2} s{self.stages2}")


def default_tiles(num_pairs: int, num_local: int, h: int, inter: int,
                  elem_bytes: int = 2) -> MoeTiles:
    """Tiles from the mean pairs per expert if routing were uniform (no sync). ``block_m``
    covers the mean plus three standard deviations (Poisson), so most experts fit one block
    and their weights are streamed once. Four regimes, decode (<= 16 rows per expert), mid
    (<= 64), prefill and long prefill (> 256), each with the launch shape
    ``bench/moe_tiles.py`` found best for it (bench/RESULTS.md, "Kernel tuning history").
    ``elem_bytes`` 4 (fp32) halves block_k so the pipelined tiles still fit in shared memory.
    """
    avg = num_pairs / max(num_local, 1)
    want = avg + 3.0 * avg ** 0.5
    if want <= 16:
        bm, g1, g2 = 16, (64, 128, 4, 5), (64, 128, 4, 3)
    elif want <= 64:
        bm, g1, g2 = (32 if want <= 32 else 64), (128, 128, 8, 2), (128, 128, 4, 2)
    elif want <= 256:
        bm, g1, g2 = 64, (256, 64, 8, 3), (256, 32, 4, 4)
    else:  # long prefill chunks (T >= ~3,500 tokens at top-8 of 128)
        bm, g1, g2 = 128, (128, 64, 8, 4), (256, 64, 8, 4)

    def fit(block: int, dim: int) -> int:
        return min(block, max(16, triton.next_power_of_2(dim)))

    def k_fit(block: int, dim: int) -> int:
        return fit(max(16, block * 2 // max(elem_bytes, 2)), dim)

    return MoeTiles(block_m=bm,
                    block_n1=fit(g1[0], inter), block_k1=k_fit(g1[1], h), warps1=g1[2],
                    stages1=g1[3],
                    block_n2=fit(g2[0], h), block_k2=k_fit(g2[1], inter), warps2=g2[2],
                    stages2=g2[3])


def launch_class(num_pairs: int, num_local: int, h: int, inter: int,
                 elem_bytes: int = 2) -> tuple[MoeTiles, str]:
    """What ``fused_moe_pairs_triton`` launches for ``num_pairs`` (token, k) pairs without tile
    overrides: its ``default_tiles`` and its layout, ``"pairs"`` (a block per pair, no
    layout), ``"kernel"`` (``moe_align``) or ``"torch"`` (``moe_align_torch``). Two pair counts
    of one class launch the same kernel variants (Triton compiles each class once)."""
    layout = ("pairs" if num_pairs <= PAIR_BLOCKS_MAX_PAIRS else
              "kernel" if num_pairs <= ALIGN_IN_KERNEL_MAX_PAIRS else "torch")
    return default_tiles(num_pairs, num_local, h, inter, elem_bytes), layout


def _launch(a, b, c, w, sorted_ids, block_expert, n, kd, num_slots, top_k, up_offset, block_m, *,
            block_n, block_k, warps, stages, a_by_pair, c_by_pair, fuse_silu, mul_weight,
            pair_blocks, expert_offset, num_local):
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    _moe_gemm_kernel[grid](
        a, b, c, w, sorted_ids, block_expert, num_slots, top_k, up_offset, expert_offset,
        num_local,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        N=n, KD=kd, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, A_BY_PAIR=a_by_pair,
        C_BY_PAIR=c_by_pair, FUSE_SILU=fuse_silu, MUL_WEIGHT=mul_weight, PRECISION=precision,
        PAIR_BLOCKS=pair_blocks, num_warps=warps, num_stages=stages, **pdl(_moe_gemm_kernel))


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, expert_offset: int = 0, *,
                     block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, tiles: MoeTiles | None = None) -> torch.Tensor:
    """Triton implementation of ``fused_moe_ref`` (same contract). Returns [T, H] x.dtype:
    ``combine_pairs_triton`` of ``fused_moe_pairs_triton`` (the keywords are its)."""
    y, ids = fused_moe_pairs_triton(x, w13, w2, topk_ids, topk_weights, expert_offset,
                                    block_m=block_m, block_n=block_n, block_k=block_k,
                                    tiles=tiles)
    return combine_pairs_triton(y, ids, expert_offset, w13.shape[0])


def combine_pairs_triton(y: torch.Tensor, ids: torch.Tensor, expert_offset: int,
                         num_local: int) -> torch.Tensor:
    """Each token's routed output from its pair rows in one launch: ``out[t] = sum over k of
    y[t * K + k]`` over the k with ``ids[t, k]`` in ``[expert_offset, expert_offset +
    num_local)``, in float32, rounded to y's dtype. y: [T * K, H] contiguous, one of
    ``DTYPES``; ids: [T, K] int64 or int32, contiguous. Returns a new [T, H]."""
    if y.dim() != 2 or ids.dim() != 2 or y.shape[0] != ids.numel():
        raise ValueError(f"combine_pairs_triton: y {tuple(y.shape)} and ids "
                         f"{tuple(ids.shape)} must be [T * K, H] and [T, K]")
    if y.dtype not in DTYPES or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"combine_pairs_triton: y's dtype {y.dtype} must be one of {DTYPES}, "
                         f"ids' {ids.dtype} int64 or int32")
    if not (y.is_contiguous() and ids.is_contiguous()) or y.device != ids.device:
        raise ValueError("combine_pairs_triton: y and ids must be contiguous, on one device")
    (t, top_k), h = ids.shape, y.shape[1]
    out = torch.empty((t, h), dtype=y.dtype, device=y.device)
    if out.numel():
        block_h = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, block_h))](y, ids, out, h, num_local, expert_offset,
                                                       TOP_K=top_k, BLOCK_H=block_h,
                                                       **pdl(_combine_kernel))
    return out


def fused_moe_pairs_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                           expert_offset: int = 0, *, block_m: int | None = None,
                           block_n: int | None = None, block_k: int | None = None,
                           tiles: MoeTiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline up to the combine (arguments as ``fused_moe_ref``'s). Returns ``(y, ids)``:
    y [T * K, H] x.dtype, row ``t * K + k`` pair (t, k)'s weighted expert output, written
    only for local experts (the other rows hold anything); ids the contiguous [T, K] topk_ids
    (``combine_pairs_triton(y, ids, expert_offset, E)`` is ``fused_moe_triton``'s output).

    ``tiles`` sets every tile size and the launch shape (default: ``default_tiles``);
    block_m / block_n / block_k override single sizes of it (each >= 16, powers of two).
    """
    name = "fused_moe_pairs_triton"
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [T, H], got {tuple(x.shape)}")
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{name}: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be 3-D "
                         f"[E, 2I, H] and [E, H, I]")
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"{name}: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 "
                         f"{tuple(w2.shape)} must be [T, H], [E, 2I, H], [E, H, I]")
    inter = two_i // 2
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(f"{name}: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{t}, K]")
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: topk_ids must be int64 or int32, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"{name}: topk_weights must be floating, got {topk_weights.dtype}")
    if x.dtype not in DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"{name}: x, w13, w2 must share one of {DTYPES}, got "
                         f"{x.dtype}, {w13.dtype}, {w2.dtype}")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError(f"{name}: w13 and w2 must be contiguous")
    devices = {x.device, w13.device, w2.device, topk_ids.device, topk_weights.device}
    if len(devices) != 1:
        raise ValueError(f"{name}: all tensors must be on one device, got {devices}")
    top_k = topk_ids.shape[1]
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    if t == 0 or top_k == 0 or e == 0:  # nothing to compute: no local pair to read
        return torch.zeros((t * top_k, h), dtype=x.dtype, device=x.device), ids
    default, layout = launch_class(t * top_k, e, h, inter, x.element_size())
    tiles = default if tiles is None else tiles
    over = {k: v for k, v in (("block_m", block_m), ("block_n1", block_n), ("block_n2", block_n),
                              ("block_k1", block_k), ("block_k2", block_k)) if v is not None}
    if over:
        tiles = replace(tiles, **over)
    block_m = tiles.block_m
    pair_blocks = layout == "pairs"
    if pair_blocks:  # one block per pair, experts read from topk_ids: no layout to build
        block_expert, sorted_ids = ids.reshape(-1), ids  # sorted_ids: unused
        inter_rows = t * top_k * block_m
    else:  # static-size layout, no host sync (CUDA graphs); blocks with expert -1 exit at once
        align = moe_align if layout == "kernel" else moe_align_torch
        sorted_ids, block_expert = align(topk_ids, e, expert_offset, block_m)
        inter_rows = sorted_ids.numel()
    x = x.contiguous() if x.stride(-1) != 1 else x
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    num_slots = t * top_k

    # GEMM 1: x[p // K] @ w13[e]^T, SiLU(gate) * up -> intermediate in sorted order.
    inter_buf = torch.empty((inter_rows, inter), dtype=x.dtype, device=x.device)
    _launch(x, w13, inter_buf, weights, sorted_ids, block_expert, inter, h, num_slots, top_k,
            inter, block_m, block_n=tiles.block_n1, block_k=tiles.block_k1, warps=tiles.warps1,
            stages=tiles.stages1, a_by_pair=True, c_by_pair=False, fuse_silu=True,
            mul_weight=False, pair_blocks=pair_blocks, expert_offset=expert_offset, num_local=e)

    # GEMM 2: intermediate @ w2[e]^T * weight -> y[p] (x.dtype); non-local rows stay unwritten.
    y = torch.empty((num_slots, h), dtype=x.dtype, device=x.device)
    _launch(inter_buf, w2, y, weights, sorted_ids, block_expert, h, inter, num_slots, top_k,
            0, block_m, block_n=tiles.block_n2, block_k=tiles.block_k2, warps=tiles.warps2,
            stages=tiles.stages2, a_by_pair=False, c_by_pair=True, fuse_silu=False,
            mul_weight=True, pair_blocks=pair_blocks, expert_offset=expert_offset, num_local=e)
    return y, ids
