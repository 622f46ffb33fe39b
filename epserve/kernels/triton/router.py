"""Triton router post-processing: softmax + top-K + optional renormalisation in ONE launch.

Same contract as ``epserve.kernels.router.topk_softmax_ref`` (the definition): logits [T, E]
float32/float16/bfloat16 -> ``(topk_ids [T, K] int64, topk_weights [T, K] float32)``; float32
softmax over E; ids in descending prob order, equal probs to the lower expert id; NaN probs rank
above every number; weights divided by their sum when ``renormalize``.

Layout: each program owns ``BLOCK_T`` token rows as one [BLOCK_T, next_pow2(E)] register tile
(E <= 512; columns >= E are masked); top-K is K rounds of row max + lowest-index argmax, each
round striking out its pick. The launch reads only shapes on the host (no sync) and allocates
only [T, K] outputs, so it can be captured in a CUDA graph. Importing this module imports triton;
kernels decorated while ``TRITON_INTERPRET=1`` is set run in the Triton interpreter (CPU ok).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import DTYPES, MAX_TRITON_EXPERTS, check_router_args, use_triton
from epserve.kernels.triton.pdl import pdl

_TILE_ELEMS = 1024  # BLOCK_T * BLOCK_E per program


@triton.jit
def softmax_topk_tile(x, col_ok, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Softmax + top-K of a [BLOCK_T, BLOCK_E] float32 logit tile (``col_ok``: [BLOCK_E], the
    real expert columns; the others must hold -inf). Returns ``(ids [BLOCK_T, BLOCK_K] int32,
    weights [BLOCK_T, BLOCK_K] float32)``, columns >= TOP_K zero. Shared with the fused
    norm + router kernel (``norm_router.py``).

    TOP_K is a compile-time constant (the round loop is unrolled; the interpreter cannot loop
    over a runtime bound). Selection key: the prob, 2.0 for a NaN prob (above any prob, as
    torch.sort ranks NaN), -inf for padded columns and already-picked experts; since
    TOP_K <= E, every round finds a real column.
    """
    cols = tl.arange(0, BLOCK_E)
    row_max = tl.max(x, axis=1)
    num = tl.where(col_ok[None, :], tl.exp(x - row_max[:, None]), 0.0)
    probs = num / tl.sum(num, axis=1)[:, None]  # [BLOCK_T, BLOCK_E] float32
    key = tl.where(col_ok[None, :], tl.where(probs != probs, 2.0, probs), float("-inf"))

    kk = tl.arange(0, BLOCK_K)
    out_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    out_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)  # [BLOCK_T]
        idx = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK_E), axis=1)
        key = tl.where(cols[None, :] == idx[:, None], float("-inf"), key)
        w = tl.where(best == 2.0, float("nan"), best)  # the key is the prob, except for NaN
        out_w = tl.where(kk[None, :] == k, w[:, None], out_w)
        out_i = tl.where(kk[None, :] == k, idx[:, None], out_i)
    if RENORMALIZE:
        out_w = out_w / tl.sum(out_w, axis=1)[:, None]  # columns >= TOP_K hold 0
    return out_i, out_w


@triton.jit(do_not_specialize=["num_tokens"])  # varies per step: one compile
def _topk_softmax_kernel(logits_ptr, ids_ptr, weights_ptr, num_tokens, num_experts, stride_t,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Rows ``[pid * BLOCK_T, +BLOCK_T)``: softmax, K argmax rounds, store ids and weights."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < num_experts
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_t + cols[None, :]
    x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))  # rows past T stay finite (zeros)

    out_i, out_w = softmax_topk_tile(x, col_ok, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E, BLOCK_K)
    kk = tl.arange(0, BLOCK_K)
    out_off = rows[:, None].to(tl.int64) * TOP_K + kk[None, :]
    out_ok = row_ok[:, None] & (kk[None, :] < TOP_K)
    tl.store(ids_ptr + out_off, out_i.to(tl.int64), mask=out_ok)
    tl.store(weights_ptr + out_off, out_w, mask=out_ok)


def topk_softmax_triton(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                        block_t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of ``topk_softmax_ref`` (same contract), one kernel launch.

    logits: [T, E] float32/float16/bfloat16 with E <= 512 and unit stride along E (any row
    stride), on CUDA (or anywhere under ``TRITON_INTERPRET=1``). Returns fresh
    ``topk_ids [T, K] int64`` and ``topk_weights [T, K] float32`` on logits' device.
    block_t overrides the rows per program (a power of two >= 1). Raises ValueError otherwise.
    """
    name = "topk_softmax_triton"
    check_router_args(name, logits, top_k)
    if logits.dtype not in DTYPES:
        raise ValueError(f"{name}: logits dtype must be one of {DTYPES}, got {logits.dtype}")
    t, e = logits.shape
    if e > MAX_TRITON_EXPERTS:
        raise ValueError(f"{name}: at most {MAX_TRITON_EXPERTS} experts, got E={e}")
    if logits.stride(1) != 1:
        raise ValueError(f"{name}: logits must be contiguous along experts (stride(1) == 1), "
                         f"got strides {tuple(logits.stride())}")
    if not use_triton(logits):
        raise ValueError(f"{name}: logits must be on a CUDA device (or set TRITON_INTERPRET=1), "
                         f"got {logits.device}")
    if block_t is not None and (isinstance(block_t, bool) or not isinstance(block_t, int)
                                or block_t < 1 or block_t & (block_t - 1)):
        raise ValueError(f"{name}: block_t must be a power of two >= 1, got {block_t!r}")

    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, weights
    block_e = triton.next_power_of_2(e)
    if block_t is None:  # T is a shape, not data: one compile per power of two up to the cap
        block_t = min(triton.next_power_of_2(t), max(1, _TILE_ELEMS // block_e))
    grid = (triton.cdiv(t, block_t),)
    _topk_softmax_kernel[grid](
        logits, ids, weights, t, e, logits.stride(0),
        TOP_K=top_k, RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4 if block_t * block_e >= 512 else 2,
        **pdl(_topk_softmax_kernel))
    return ids, weights
