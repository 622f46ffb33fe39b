"""Triton GEMV: one activation row times a [N, K] weight, streamed at HBM speed.

Same contract as ``epserve.kernels.linear.linear_ref`` for ``M == 1``. Layout: program ``p``
owns output columns ``[p * BLOCK_N, +BLOCK_N)`` and walks K in ``BLOCK_K`` steps, accumulating
``w * x`` elementwise in a float32 [BLOCK_N, BLOCK_K] tile (no tensor-core padding of the one
row to 16), reduced once at the end. K is a compile-time constant (one compile per layer shape;
the software pipeline keeps ``num_stages`` weight tiles in flight). Many small programs (a few
per SM, all resident at once) rather than split-K: no reduce launch, no atomics.

Importing this module imports triton; kernels decorated while ``TRITON_INTERPRET=1`` is set run
in the Triton interpreter (CPU tensors allowed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import DTYPES, check_devices, interpreted
from epserve.kernels.triton.pdl import pdl


@triton.jit
def gemv_block(x_ptr, w_ptr, rows, N, stride_wn,
               K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 dot products ``w[r] . x`` of the ``BLOCK_N`` rows ``rows`` (those at or past
    N read as zero): one GEMV block, also the body of the kernels that fuse one."""
    r_ok = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        c_ok = cols < K
        w = tl.load(w_rows + cols[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)
        xv = tl.load(x_ptr + cols, mask=c_ok, other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_wn,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = gemv_block(x_ptr, w_ptr, rows, N, stride_wn, K, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


INTERPRETED = interpreted(_gemv_kernel)


def default_gemv_tiles(n: int, k: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages): 2 KB of each weight row per step; up to
    N = 4096 output rows (an o_proj) 8 rows / 8 warps / 3 stages per program, wider (a qkv
    projection) 4 rows / 4 warps / 4 stages, each the best of a sweep (bench/RESULTS.md,
    "Kernel tuning history")."""
    block_k = min(triton.next_power_of_2(k), max(16, 2048 // elem_bytes))
    if n <= 4096:
        return 8, block_k, 8, 3
    return 4, block_k, 4, 4


def linear_gemv_triton(x: torch.Tensor, w: torch.Tensor, *, block_n: int | None = None,
                       block_k: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None) -> torch.Tensor:
    """``linear_ref`` for one row: x [1, K] (last dim contiguous), w [N, K] (rows contiguous),
    same dtype in ``DTYPES``. Returns a new [1, N] tensor. The keywords override the tiles
    (powers of two) and launch shape. Raises ValueError otherwise."""
    name = "linear_gemv_triton"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be [M, K] and w {tuple(w.shape)} [N, K]")
    if x.shape[0] != 1:
        raise ValueError(f"{name}: one row only, got x with {x.shape[0]} rows")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(f"{name}: x {x.dtype} and w {w.dtype} must share one of {DTYPES}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{name}: x and w need a contiguous last dim, strides {x.stride()} "
                         f"{w.stride()}")
    check_devices(name, [x, w], INTERPRETED, "epserve.kernels.triton.linear")
    n, k = w.shape
    bn, bk, nw, ns = default_gemv_tiles(n, k, x.element_size())
    bn, bk = block_n or bn, block_k or bk
    for label, v in (("block_n", bn), ("block_k", bk)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}: {label} must be a power of two, got {v}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if k == 0:
        return out.zero_()
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, out, n, w.stride(0), K=k, BLOCK_N=bn, BLOCK_K=bk,
                                        num_warps=num_warps or nw, num_stages=num_stages or ns,
                                        **pdl(_gemv_kernel))
    return out
