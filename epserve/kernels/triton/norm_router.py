"""Triton residual-add + RMSNorm + router GEMV + softmax-top-K in ONE launch (decode sizes).

Same contract as ``epserve.kernels.router.add_norm_router_ref`` (the definition): the MoE
block's pre-norm and its router, which at decode sizes were four launches (add+norm, the
router GEMM, its top-K) for ~1 MB of traffic, each launch costing more than its bytes.

Layout: grid ``(T, NB)``. Program ``(t, b)`` recomputes row t's add + norm (a few KB; program
``b == 0`` stores ``normed`` and ``new_residual``), multiplies it by router rows
``[b * BLOCK_E, +BLOCK_E)`` (float32 accumulate, rounded to x.dtype as ``F.linear`` rounds)
and stores those logits into a float32 scratch row. Then it increments row t's arrival counter
(an acq_rel atomic: its logits are visible before the count); the program that arrives last
reads the whole row back (volatile loads: not from a stale L1 line), runs the shared
``softmax_topk_tile`` and resets the counter to 0 for the next call. The counters live in one
zeroed int32 buffer per device, made on first use and reset by every launch, so the kernel is
CUDA-graph capturable (no host sync, no memset node).

With ``zero_centred`` the norm weight is the hybrids' zero-centred one (``1 + w`` in float32,
as ``fused_add_zero_centred_rms_norm_ref``).

Importing this module imports triton; kernels decorated while ``TRITON_INTERPRET=1`` is set run
in the Triton interpreter (CPU tensors allowed; programs run one after another there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import (DTYPES, MAX_FUSED_TOKENS, MAX_NORM_H, MAX_TRITON_EXPERTS,
                                      check_devices, interpreted)
from epserve.kernels.triton.pdl import pdl
from epserve.kernels.triton.router import softmax_topk_tile

MAX_H = MAX_NORM_H
# BLOCK_E * BLOCK_H per program: 2 router rows (8 KB bf16) at H=2048, 64 programs of one warp
# (the best of a sweep, bench/RESULTS.md "Kernel tuning history"); more warps per program
# only add cross-warp reductions.
_W_TILE_ELEMS = 4096
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _norm_router_kernel(x_ptr, r_ptr, nw_ptr, gw_ptr, out_ptr, res_out_ptr, logits_ptr,
                        count_ptr, ids_ptr, weights_ptr, slots_ptr, H, E, eps,
                        HAS_SLOTS: tl.constexpr, NUM_BLOCKS: tl.constexpr, TOP_K: tl.constexpr,
                        RENORMALIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_E_ALL: tl.constexpr,
                        BLOCK_K: tl.constexpr, ZERO_CENTRED: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs = tl.arange(0, BLOCK_H)
    h_ok = offs < H
    x = tl.load(x_ptr + t * H + offs, mask=h_ok, other=0.0)
    dtype = x.dtype
    r = tl.load(r_ptr + t * H + offs, mask=h_ok, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded as torch's x + residual
    sf = s.to(tl.float32)
    nw = tl.load(nw_ptr + offs, mask=h_ok, other=0.0).to(tl.float32)
    if ZERO_CENTRED:  # the hybrids' (1 + w), in float32, one cast (as the norm kernel)
        normed = ((sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)) * (1.0 + nw)).to(dtype)
    else:
        normed = (sf * tl.rsqrt(tl.sum(sf * sf, axis=0) / H + eps)).to(dtype)
        normed = (nw * normed.to(tl.float32)).to(dtype)  # exactly the norm kernel's rounding
    if b == 0:
        tl.store(res_out_ptr + t * H + offs, s, mask=h_ok)
        tl.store(out_ptr + t * H + offs, normed, mask=h_ok)

    e = b * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    w = tl.load(gw_ptr + e[:, None].to(tl.int64) * H + offs[None, :],
                mask=e_ok[:, None] & h_ok[None, :], other=0.0)
    logit = tl.sum(w.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)  # [BLOCK_E]
    logit = logit.to(dtype).to(tl.float32)  # the router output is x.dtype, as F.linear's
    tl.store(logits_ptr + t * E + e, logit, mask=e_ok)

    arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if arrived == NUM_BLOCKS - 1:  # the last program of row t: every slice is stored
        cols = tl.arange(0, BLOCK_E_ALL)
        col_ok = cols < E
        row = tl.load(logits_ptr + t * E + cols[None, :], mask=col_ok[None, :],
                      other=float("-inf"), volatile=True)  # [1, BLOCK_E_ALL]
        out_i, out_w = softmax_topk_tile(row, col_ok, TOP_K, RENORMALIZE, 1, BLOCK_E_ALL,
                                         BLOCK_K)
        if HAS_SLOTS:  # a padding row (slot < 0) routes nowhere: id -1, weight 0
            keep = (tl.load(slots_ptr + t) >= 0).to(tl.int32)
            out_i = out_i * keep + (keep - 1)
            out_w = out_w * keep.to(tl.float32)
        kk = tl.arange(0, BLOCK_K)
        k_ok = kk[None, :] < TOP_K
        tl.store(ids_ptr + t * TOP_K + kk[None, :], out_i.to(tl.int64), mask=k_ok)
        tl.store(weights_ptr + t * TOP_K + kk[None, :], out_w, mask=k_ok)
        tl.atomic_xchg(count_ptr + t, 0)


INTERPRETED = interpreted(_norm_router_kernel)


def _counters(device: torch.device) -> torch.Tensor:
    """The per-device arrival counters (zero between launches: each launch resets its own)."""
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = _COUNTERS[device] = torch.zeros(MAX_FUSED_TOKENS, dtype=torch.int32, device=device)
    return buf


def add_norm_router_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, router_weight: torch.Tensor, top_k: int,
                           renormalize: bool, *, row_slots: torch.Tensor | None = None,
                           block_e: int | None = None, num_warps: int | None = None,
                           zero_centred: bool = False):
    """Triton ``add_norm_router_ref`` (same contract, ``zero_centred`` too), one launch.

    x, residual: [T, H] contiguous, same dtype (fp32/fp16/bf16), T <= ``MAX_FUSED_TOKENS``;
    norm_weight: [H]; router_weight: [E, H] contiguous, x's dtype, E <= 512. Returns
    ``(normed [T, H], new_residual [T, H], topk_ids [T, K] int64, topk_weights [T, K] float32)``.
    ``row_slots`` ([T] int, each row's KV slot): a row with a negative slot is padding and gets
    ids -1 and weights 0, so the MoE reads no expert for it (its output is never read).
    ``block_e`` overrides the router rows per program (a power of two), ``num_warps`` the warps
    per program. ValueError otherwise.
    """
    name = "add_norm_router_triton"
    if x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} and residual "
                         f"{tuple(residual.shape)} {residual.dtype} must be the same [T, H]")
    t, h = x.shape
    if not 1 <= h <= MAX_H or t > MAX_FUSED_TOKENS:
        raise ValueError(f"{name}: T={t} must be <= {MAX_FUSED_TOKENS} and H={h} in [1, {MAX_H}]")
    if norm_weight.shape != (h,) or router_weight.dim() != 2 or router_weight.shape[1] != h:
        raise ValueError(f"{name}: norm_weight {tuple(norm_weight.shape)} must be [{h}] and "
                         f"router_weight {tuple(router_weight.shape)} [E, {h}]")
    e = router_weight.shape[0]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= e:
        raise ValueError(f"{name}: top_k must be an int in [1, E={e}], got {top_k!r}")
    if e > MAX_TRITON_EXPERTS:
        raise ValueError(f"{name}: at most {MAX_TRITON_EXPERTS} experts, got E={e}")
    if x.dtype not in DTYPES or router_weight.dtype != x.dtype or norm_weight.dtype not in DTYPES:
        raise ValueError(f"{name}: x {x.dtype} (one of {DTYPES}), router_weight "
                         f"{router_weight.dtype} must match it, norm_weight {norm_weight.dtype}")
    if not (x.is_contiguous() and residual.is_contiguous() and router_weight.is_contiguous()
            and norm_weight.is_contiguous()):
        raise ValueError(f"{name}: x, residual, norm_weight and router_weight must be contiguous")
    if row_slots is not None and (row_slots.shape != (t,) or row_slots.dtype not in
                                  (torch.int32, torch.int64)):
        raise ValueError(f"{name}: row_slots {tuple(row_slots.shape)} {row_slots.dtype} must be "
                         f"[{t}] int32 or int64")
    check_devices(name, [x, residual, norm_weight, router_weight]
                  + ([] if row_slots is None else [row_slots]), INTERPRETED,
                  "epserve.kernels.triton.norm_router")
    block_h = triton.next_power_of_2(h)
    if block_e is None:
        block_e = max(1, min(triton.next_power_of_2(e), _W_TILE_ELEMS // block_h))
    elif isinstance(block_e, bool) or not isinstance(block_e, int) or block_e < 1 \
            or block_e & (block_e - 1):
        raise ValueError(f"{name}: block_e must be a power of two >= 1, got {block_e!r}")
    dev = x.device
    normed, new_res = torch.empty_like(x), torch.empty_like(x)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    if t == 0:
        return normed, new_res, ids, weights
    logits = torch.empty((t, e), dtype=torch.float32, device=dev)
    nb = triton.cdiv(e, block_e)
    _norm_router_kernel[(t, nb)](
        x, residual, norm_weight, router_weight, normed, new_res, logits, _counters(dev),
        ids, weights, ids if row_slots is None else row_slots, h, e, float(eps),
        HAS_SLOTS=row_slots is not None, NUM_BLOCKS=nb, TOP_K=top_k,
        RENORMALIZE=bool(renormalize), BLOCK_H=block_h, BLOCK_E=block_e, BLOCK_E_ALL=triton.next_power_of_2(e),
        BLOCK_K=triton.next_power_of_2(top_k), ZERO_CENTRED=bool(zero_centred),
        num_warps=num_warps or (1 if block_h <= 2048 else 4), **pdl(_norm_router_kernel))
    return normed, new_res, ids, weights
