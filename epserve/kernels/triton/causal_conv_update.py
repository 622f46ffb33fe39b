"""Triton causal-conv steps over a per-slot state pool: one token per sequence (decode), or a
few (a speculative verify's k + 1, a fold's accepted prefix), the conv states read and written
in place.

Same contract as ``causal_conv1d_ref`` (the definition) over each sequence's segment, the
states gathered from and scattered back to ``state_pool[slots]``: channel c of token t is
``silu(sum_j w[c, j] * x_ext[t - (K - 1) + j, c])`` where ``x_ext[i]`` is the segment's input
i for i >= 0 and column K - 1 + i of the slot's state (its last K - 1 inputs; zeros where
``fresh[s]``: nothing is read) for i < 0; the slot's state becomes the last K - 1 inputs after
the segment. Only the sequences' slots are written; padded rows of a CUDA graph all name the
spare slot, which they may overwrite. Both kernels share ``_conv_program`` (the program's
sequence, channels and slot), ``_slot_row``, ``_tap`` and ``_store_out`` (SiLU, the store).

``_conv_update_kernel`` (decode): grid (sequence, block of channels). The window is unrolled
over K (``MAX_CONV_WIDTH``), one [BC] column vector at a time, so every column of a channel is
loaded and stored by the same thread: the in-place shift needs no barrier. Nothing is read from
the host: a CUDA graph replays it with new slots and lengths.

``_conv_varlen_kernel`` (a few tokens per sequence): grid (sequence, block of channels);
sequence s owns packed rows ``[cu[s], cu[s + 1])`` (offsets on the device, trusted: 0 first, T
last, non-decreasing). A runtime loop over its tokens computes each output from loads alone
(``_window``: x rows or old-state columns, no register shifting); then, unless ``hold[s]``,
a second pass writes the new state's K - 1 columns, each read (from x, or a later old column)
before a ``tl.debug_barrier()`` and stored after it: a channel's value may live in several
threads of a layout, and none may store a column another has yet to read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import (DTYPES, MAX_CONV_WIDTH, check_devices, check_state_step,
                                      interpreted)
from epserve.kernels.triton.pdl import pdl


@triton.jit
def _conv_program(slot_ptr, fresh_ptr, C, BC: tl.constexpr):
    """The program's sequence s, its channels (offsets and in-range mask), its slot and the
    bound below which a channel's old state is read (0 where fresh[s]: its past is zeros, nothing
    read; an integer bound, as a scalar bool in a tensor mask is refused by newer Triton
    interpreters)."""
    s = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    slot = tl.load(slot_ptr + s).to(tl.int64)
    live_c = tl.where(tl.load(fresh_ptr + s) != 0, 0, C)
    return s, offs_c, mask_c, slot, live_c


@triton.jit
def _slot_row(pool_ptr, slot, offs_c, stride_pn, stride_pc):
    """Pointers to the channels' state column 0 in the slot."""
    return pool_ptr + slot * stride_pn + offs_c.to(tl.int64) * stride_pc


@triton.jit
def _tap(w_row, j, mask_c):
    """Weight column j of the channels, in float32."""
    return tl.load(w_row + j, mask=mask_c, other=0.0).to(tl.float32)


@triton.jit
def _store_out(acc, y_row, offs_c, mask_c, SILU: tl.constexpr):
    """The float32 sums, SiLU'd where SILU, stored in the output row's dtype."""
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_row + offs_c, acc.to(y_row.dtype.element_ty), mask=mask_c)


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, pool_ptr, slot_ptr, fresh_ptr, y_ptr,
                        stride_xs, stride_wc, stride_pn, stride_pc, stride_pk, stride_ys, C,
                        K: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s, offs_c, mask_c, slot, live_c = _conv_program(slot_ptr, fresh_ptr, C, BC)
    x_raw = tl.load(x_ptr + s * stride_xs + offs_c, mask=mask_c, other=0.0)
    row = _slot_row(pool_ptr, slot, offs_c, stride_pn, stride_pc)
    w_row = w_ptr + offs_c * stride_wc
    acc = _tap(w_row, K - 1, mask_c) * x_raw.to(tl.float32)
    for j in tl.static_range(K - 1):
        past = tl.load(row + j * stride_pk, mask=offs_c < live_c, other=0.0)
        acc += _tap(w_row, j, mask_c) * past.to(tl.float32)
        if j > 0:  # the window moves on: column j becomes column j - 1
            tl.store(row + (j - 1) * stride_pk, past, mask=mask_c)
    tl.store(row + (K - 2) * stride_pk, x_raw.to(pool_ptr.dtype.element_ty), mask=mask_c)
    _store_out(acc, y_ptr + s * stride_ys, offs_c, mask_c, SILU)


@triton.jit
def _window(x_ptr, stride_xt, start, row, stride_pk, i, offs_c, C, live_c, K: tl.constexpr):
    """The sequence's input i (from -(K - 1)) in float32: x's packed row start + i where
    i >= 0, else column K - 1 + i of the old state (zeros from live_c on). Loads only."""
    xv = tl.load(x_ptr + (start + i) * stride_xt + offs_c, mask=offs_c < tl.where(i >= 0, C, 0),
                 other=0.0)
    sv = tl.load(row + (K - 1 + i) * stride_pk, mask=offs_c < tl.where(i < 0, live_c, 0),
                 other=0.0)
    return tl.where(i >= 0, xv.to(tl.float32), sv.to(tl.float32))


# a verify's x is a view of a wider projection row, a short prompt's its own: one compile
@triton.jit(do_not_specialize=["stride_xt"])
def _conv_varlen_kernel(x_ptr, w_ptr, pool_ptr, slot_ptr, fresh_ptr, cu_ptr, hold_ptr, y_ptr,
                        stride_xt, stride_wc, stride_pn, stride_pc, stride_pk, stride_yt, C,
                        K: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s, offs_c, mask_c, slot, live_c = _conv_program(slot_ptr, fresh_ptr, C, BC)
    row = _slot_row(pool_ptr, slot, offs_c, stride_pn, stride_pc)
    start = tl.load(cu_ptr + s).to(tl.int64)
    n = (tl.load(cu_ptr + s + 1).to(tl.int64) - start).to(tl.int32)
    w_row = w_ptr + offs_c * stride_wc
    for t in range(0, n):  # the outputs: every input read where it lies, nothing stored
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(K):
            acc += _tap(w_row, j, mask_c) * _window(x_ptr, stride_xt, start, row, stride_pk,
                                                    t + (j - (K - 1)), offs_c, C, live_c, K)
        _store_out(acc, y_ptr + (start + t) * stride_yt, offs_c, mask_c, SILU)
    # The new state: column m is input n - (K - 1) + m, from x or from old column n + m >= m
    # (so ascending m never reads a column already stored). Each column is read by every
    # thread, the old state's earlier reads included, before the barrier; stored after it.
    keep_c = tl.where(tl.load(hold_ptr + s) != 0, 0, C)  # a held sequence: nothing stored
    for m in tl.static_range(K - 1):
        v = _window(x_ptr, stride_xt, start, row, stride_pk, n + (m - (K - 1)), offs_c, C,
                    live_c, K)
        tl.debug_barrier()
        tl.store(row + m * stride_pk, v.to(pool_ptr.dtype.element_ty), mask=offs_c < keep_c)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
INTERPRETED = interpreted(_conv_update_kernel)
_MODULE = "epserve.kernels.triton.causal_conv_update"


def _check_conv(name: str, x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """x [T, C] and weight [C, K] (2 <= K <= ``MAX_CONV_WIDTH``), both of ``DTYPES`` with a
    contiguous last dim. Returns (C, K)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be [S, C] and weight "
                         f"{tuple(weight.shape)} [C, K]")
    kw = weight.shape[1]
    if not 2 <= kw <= MAX_CONV_WIDTH:
        raise ValueError(f"{name}: conv width {kw} outside [2, {MAX_CONV_WIDTH}]")
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"{name}: x {x.dtype} and weight {weight.dtype} must be in {DTYPES}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name}: x and weight need a contiguous last dim")
    return x.shape[1], kw


def _tiles(c: int) -> tuple[int, int]:
    """The channel block and warps of both kernels."""
    bc = min(triton.next_power_of_2(c), 512)
    return bc, 4 if bc >= 256 else 2


def causal_conv_update_triton(x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor,
                              slots: torch.Tensor, fresh: torch.Tensor,
                              silu: bool = True) -> torch.Tensor:
    """One decode token per sequence through the causal conv, the pool updated in place.

    x: [S, C] (fp32/fp16/bf16, last dim contiguous, any row stride); weight: [C, K]
    (2 <= K <= ``MAX_CONV_WIDTH``, last dim contiguous); state_pool: [N, C, K - 1]
    (fp32/fp16/bf16, any strides); slots: [S] int64/int32; fresh: [S] bool. Returns y [S, C]
    in x's dtype (SiLU applied unless ``silu=False``)."""
    name = "causal_conv_update_triton"
    c, kw = _check_conv(name, x, weight)
    s = x.shape[0]
    check_state_step(name, state_pool, (c, kw - 1), slots, fresh, rows=s)
    check_devices(name, (x, weight, state_pool, slots, fresh), INTERPRETED, _MODULE)
    y = torch.empty(s, c, dtype=x.dtype, device=x.device)
    if s == 0 or c == 0:
        return y
    bc, warps = _tiles(c)
    _conv_update_kernel[(s, triton.cdiv(c, bc))](
        x, weight, state_pool, slots.contiguous(), fresh.contiguous().view(torch.uint8), y,
        x.stride(0), weight.stride(0), state_pool.stride(0), state_pool.stride(1),
        state_pool.stride(2), y.stride(0), c,
        K=kw, BC=bc, SILU=silu, num_warps=warps, **pdl(_conv_update_kernel))
    return y


def causal_conv_varlen_triton(x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor,
                              slots: torch.Tensor, fresh: torch.Tensor, cu: torch.Tensor,
                              hold_mask: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """A few tokens per sequence through the causal conv, the pool updated in place but for
    held sequences.

    x: [T, C] packed tokens (as ``causal_conv_update_triton``'s); weight, state_pool, slots,
    fresh: as there, for S sequences; cu: [S + 1] int32/int64 offsets on the device (trusted:
    0 first, T last, non-decreasing; a sequence's tokens run in a loop, so meant for a few);
    hold_mask: [S] bool/uint8, nonzero where the sequence's new state is not written back.
    Returns y [T, C] in x's dtype (SiLU applied unless ``silu=False``)."""
    name = "causal_conv_varlen_triton"
    c, kw = _check_conv(name, x, weight)
    s = check_state_step(name, state_pool, (c, kw - 1), slots, fresh)
    if cu.shape != (s + 1,) or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: cu {tuple(cu.shape)} {cu.dtype} must be [{s + 1}] int32 or "
                         f"int64")
    if hold_mask.shape != (s,) or hold_mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"{name}: hold_mask {tuple(hold_mask.shape)} {hold_mask.dtype} must be "
                         f"[{s}] bool or uint8")
    check_devices(name, (x, weight, state_pool, slots, fresh, cu, hold_mask), INTERPRETED,
                  _MODULE)
    y = torch.empty(x.shape[0], c, dtype=x.dtype, device=x.device)
    if s == 0 or c == 0:
        return y
    bc, warps = _tiles(c)
    _conv_varlen_kernel[(s, triton.cdiv(c, bc))](
        x, weight, state_pool, slots.contiguous(), fresh.contiguous().view(torch.uint8),
        cu.contiguous(), hold_mask.contiguous().view(torch.uint8), y,
        x.stride(0), weight.stride(0), state_pool.stride(0), state_pool.stride(1),
        state_pool.stride(2), y.stride(0), c,
        K=kw, BC=bc, SILU=silu, num_warps=warps, **pdl(_conv_varlen_kernel))
    return y
