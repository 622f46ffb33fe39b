"""Triton gated-delta-rule decode: one token per sequence, its recurrent state read and written
in place in the per-slot pool.

Same contract as ``recurrent_ref`` (the definition) over one-token segments, the states
gathered from and scattered back to ``state_pool[slots]``: per value head h (key head
``h // (Hv / Hk)``), with k L2-normalised and q L2-normalised and scaled,

    S <- exp(g) * S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

where ``S`` [Dk, Dv] is the slot's state (zeros where ``fresh[s]``: nothing is read), stored
back after the token. Only the sequences' slots are written; padded rows of a CUDA graph all
name the spare slot, which they may overwrite.

``gated_delta_varlen_triton`` runs a few tokens per sequence (a speculative verify's k + 1, a
fold's accepted prefix) in one launch: each program walks its sequence's rows in order, its
state tile in registers, and stores it once after the last unless the sequence is held (its
slot then keeps the state before the step: what a verify needs). Same per-token arithmetic.

``gated_delta_decode_gates_triton`` is the same launch given the layer's projections ``a``, ``b``
and its ``A_log``, ``dt_bias`` instead of g and beta: each program computes its head's
``g = -exp(A_log) * softplus(a + dt_bias)`` (float32; softplus ``log1p(exp(x))``, ``x`` above
20, as torch's) and ``beta = sigmoid(b)`` (rounded to b's dtype, as ``b.sigmoid()``), i.e.
``delta_gates_ref``, so a decode step launches no torch op for them.

Grid: (sequence, value head, block of BV value columns): each program holds a [Dk, BV] float32
tile of the state (``Dk <= MAX_DELTA_DK``); the blocks of one head share nothing but q and k.
Every stored value depends on a reduction over the whole tile, so all of it is loaded before
any of it is stored. Nothing is read from the host: a CUDA graph replays it with new slots and
lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import (DTYPES, MAX_DELTA_DK, check_devices, check_state_step,
                                      interpreted)
from epserve.kernels.triton.pdl import pdl


@triton.jit
def _delta_token(state, r, h, kh, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, alog_ptr, dtb_ptr,
                 stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                 stride_gs, stride_gh, stride_bs, stride_bh, stride_os, stride_oh,
                 offs_k, offs_v, mask_k, mask_v, scale, eps, GATES: tl.constexpr):
    """Row ``r`` (value head h, key head kh) through the rule from ``state`` [DK_P, BV]: its
    output stored, the state after it returned."""
    q = tl.load(q_ptr + r * stride_qs + kh * stride_qh + offs_k, mask=mask_k,
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + r * stride_ks + kh * stride_kh + offs_k, mask=mask_k,
                other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    v = tl.load(v_ptr + r * stride_vs + h * stride_vh + offs_v, mask=mask_v,
                other=0.0).to(tl.float32)
    if GATES:
        x = tl.load(g_ptr + r * stride_gs + h * stride_gh).to(tl.float32) \
            + tl.load(dtb_ptr + h).to(tl.float32)
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e  # log1p(e) = log(u) * e / (u - 1), exact to a few ulps (e = 0 when u == 1)
        log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        softplus = tl.where(x > 20.0, x, log1p)
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
        b_raw = tl.load(beta_ptr + r * stride_bs + h * stride_bh)
        beta = tl.sigmoid(b_raw.to(tl.float32)).to(b_raw.dtype).to(tl.float32)
    else:
        g = tl.load(g_ptr + r * stride_gs + h * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + r * stride_bs + h * stride_bh).to(tl.float32)
    state = state * tl.exp(g)
    write = beta * (v - tl.sum(state * k[:, None], axis=0))  # [BV]: what k misses, scaled
    state = state + k[:, None] * write[None, :]
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(o_ptr + r * stride_os + h * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty),
             mask=mask_v)
    return state


# a and b (GATES) are columns of a projection at an offset that differs between the layer's
# paths (a verify's, a decode's): their alignment is not specialized on (scalar loads anyway)
@triton.jit(do_not_specialize=["g_ptr", "beta_ptr"])
def _gated_delta_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, slot_ptr,
                               fresh_ptr, o_ptr, alog_ptr, dtb_ptr, cu_ptr, hold_ptr,
                               stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                               stride_gs, stride_gh, stride_bs, stride_bh,
                               stride_pn, stride_ph, stride_pk, stride_os, stride_oh,
                               group, DK, DV, scale, eps,
                               DK_P: tl.constexpr, BV: tl.constexpr, GATES: tl.constexpr,
                               VARLEN: tl.constexpr, PDL: tl.constexpr):
    """GATES: ``g_ptr`` / ``beta_ptr`` hold the projections a / b, and g, beta are computed
    here from them and ``A_log`` / ``dt_bias`` [Hv]. VARLEN: sequence s owns rows
    ``[cu[s], cu[s + 1])``, run in order from its state, which is stored back unless
    ``hold[s]``; else row s is sequence s's one token."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_k = tl.arange(0, DK_P)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < DK, offs_v < DV
    kh = h // group
    slot = tl.load(slot_ptr + s).to(tl.int64)
    # A fresh sequence starts from zeros: no row of the state is read (folded into the integer
    # bound, as a scalar bool in a tensor mask is refused by newer Triton interpreters).
    live_k = tl.where(tl.load(fresh_ptr + s) != 0, 0, DK)
    tile = (pool_ptr + slot * stride_pn + h * stride_ph + offs_k[:, None] * stride_pk
            + offs_v[None, :])
    state = tl.load(tile, mask=(offs_k[:, None] < live_k) & mask_v[None, :],
                    other=0.0).to(tl.float32)
    if VARLEN:
        for r in range(tl.load(cu_ptr + s), tl.load(cu_ptr + s + 1)):
            state = _delta_token(state, r, h, kh, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
                                 alog_ptr, dtb_ptr, stride_qs, stride_qh, stride_ks, stride_kh,
                                 stride_vs, stride_vh, stride_gs, stride_gh, stride_bs,
                                 stride_bh, stride_os, stride_oh, offs_k, offs_v, mask_k,
                                 mask_v, scale, eps, GATES)
        store_k = tl.where(tl.load(hold_ptr + s) != 0, 0, DK)  # a held state stays as it was
    else:
        state = _delta_token(state, s, h, kh, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
                             alog_ptr, dtb_ptr, stride_qs, stride_qh, stride_ks, stride_kh,
                             stride_vs, stride_vh, stride_gs, stride_gh, stride_bs, stride_bh,
                             stride_os, stride_oh, offs_k, offs_v, mask_k, mask_v, scale, eps,
                             GATES)
        store_k = DK
    tl.store(tile, state.to(pool_ptr.dtype.element_ty),
             mask=(offs_k[:, None] < store_k) & mask_v[None, :])


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
INTERPRETED = interpreted(_gated_delta_decode_kernel)


def gated_delta_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                              fresh: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """One decode token per sequence through the gated delta rule, the pool updated in place.

    q, k: [S, Hk, Dk]; v: [S, Hv, Dv] (Hv a multiple of Hk; fp32/fp16/bf16, each its own, last
    dim contiguous, other strides free); g, beta: [S, Hv] (the log decay and the write
    strength, any float dtype of ``DTYPES``, any strides); state_pool: [N, Hv, Dk, Dv] (float32
    as a rule, last dim contiguous); slots: [S] int64/int32; fresh: [S] bool. q is scaled by
    ``Dk ** -0.5`` after its L2 norm. Returns o [S, Hv, Dv] in v's dtype."""
    return _launch("gated_delta_decode_triton", q, k, v, g, beta, None, state_pool, slots, fresh,
                   eps)


def gated_delta_decode_gates_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                                    dt_bias: torch.Tensor, state_pool: torch.Tensor,
                                    slots: torch.Tensor, fresh: torch.Tensor,
                                    eps: float = 1e-6) -> torch.Tensor:
    """``gated_delta_decode_triton(q, k, v, *delta_gates_ref(a, b, A_log, dt_bias), ...)`` in
    one launch: a, b [S, Hv] (the projection's columns, any strides), A_log, dt_bias [Hv]
    (any float dtype of ``DTYPES``)."""
    return _launch("gated_delta_decode_gates_triton", q, k, v, a, b, (A_log, dt_bias),
                   state_pool, slots, fresh, eps)


def gated_delta_varlen_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                              fresh: torch.Tensor, cu: torch.Tensor, hold: torch.Tensor,
                              eps: float = 1e-6,
                              gates: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> torch.Tensor:
    """``gated_delta_decode_triton`` over T rows of S sequences: sequence s owns rows
    ``[cu[s], cu[s + 1])`` (cu [S + 1] int32/int64 on the device, non-decreasing from 0 to T:
    trusted, not read on the host) and its new state is written back unless ``hold[s]`` ([S]
    bool). One program walks a sequence's rows in order: for a few rows each. ``gates``:
    (A_log, dt_bias) [Hv], and g / beta are the projections a / b (as
    ``gated_delta_decode_gates_triton``)."""
    name = "gated_delta_varlen_triton"
    s = slots.shape[0] if slots.dim() == 1 else -1
    if cu.shape != (s + 1,) or cu.dtype not in (torch.int32, torch.int64) \
            or hold.shape != (s,) or hold.dtype != torch.bool:
        raise ValueError(f"{name}: cu {tuple(cu.shape)} {cu.dtype} must be [{s + 1}] int32/int64 "
                         f"and hold {tuple(hold.shape)} {hold.dtype} [{s}] bool")
    return _launch(name, q, k, v, g, beta, gates, state_pool, slots, fresh, eps, (cu, hold))


def _launch(name, q, k, v, g, beta, gates, state_pool, slots, fresh, eps,
            varlen: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Check, then launch the kernel (``gates``: (A_log, dt_bias), and g / beta are a / b;
    ``varlen``: (cu, hold), rows grouped by sequence)."""
    if q.dim() != 3 or q.shape != k.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)} must be [T, Hk, Dk] "
                         f"and v {tuple(v.shape)} [T, Hv, Dv]")
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hk == 0 or hv % hk or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"{name}: {hv} value heads over {hk} key heads, g/a {tuple(g.shape)} "
                         f"and beta/b {tuple(beta.shape)} must be [{t}, {hv}]")
    if dk > MAX_DELTA_DK:
        raise ValueError(f"{name}: key head dim {dk} > {MAX_DELTA_DK}")
    s = check_state_step(name, state_pool, (hv, dk, dv), slots, fresh,
                         rows=None if varlen else t)
    extra = () if gates is None else gates
    if any(t.shape != (hv,) for t in extra):
        raise ValueError(f"{name}: A_log and dt_bias {[tuple(t.shape) for t in extra]} must be "
                         f"[{hv}]")
    if any(t.dtype not in DTYPES for t in (q, k, v, g, beta, *extra)):
        raise ValueError(f"{name}: q, k, v, g, beta (a, b, A_log, dt_bias) dtypes must be in "
                         f"{DTYPES}")
    if any(t.stride(-1) != 1 for t in (q, k, v, state_pool)) and min(dk, dv) > 1:
        raise ValueError(f"{name}: q, k, v and the state pool need a contiguous last dim")
    cu, hold = varlen if varlen else (slots, fresh)  # (not read without VARLEN)
    check_devices(name, (q, k, v, g, beta, state_pool, slots, fresh, cu, hold, *extra),
                  INTERPRETED, "epserve.kernels.triton.gated_delta_decode")
    o = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    if s == 0 or dv == 0:
        return o
    alog, dtb = (g, g) if gates is None else (gates[0].contiguous(), gates[1].contiguous())
    dk_p = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(8, 4096 // dk_p))
    _gated_delta_decode_kernel[(s, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, state_pool, slots.contiguous(), fresh.contiguous().view(torch.uint8), o,
        alog, dtb, cu.contiguous(), hold.contiguous().view(torch.uint8),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        o.stride(0), o.stride(1), hv // hk, dk, dv, dk ** -0.5, eps,
        DK_P=dk_p, BV=bv, GATES=gates is not None, VARLEN=varlen is not None,
        num_warps=4 if dk_p * bv >= 2048 else 2, **pdl(_gated_delta_decode_kernel))
    return o
