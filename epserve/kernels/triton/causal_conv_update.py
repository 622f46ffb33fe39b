"""Triton causal-conv decode update: one token per sequence, its conv state read and written in
place in the per-slot pool.

Same contract as ``causal_conv1d_ref`` (the definition) over one-token segments, the states
gathered from and scattered back to ``state_pool[slots]``: channel c of sequence s is
``silu(sum_{j<K-1} w[c, j] * state[c, j] + w[c, K-1] * x[s, c])`` with ``state`` the slot's last
K - 1 inputs (zeros where ``fresh[s]``: nothing is read), and the slot's state becomes the last
K - 1 inputs after this one (the window shifted by one). Only the sequences' slots are
written; padded rows of a CUDA graph all name the spare slot, which they may overwrite.

Grid: (sequence, block of channels). The window is unrolled over K (``MAX_CONV_WIDTH``), one
[BC] column vector at a time, so every column of a channel is loaded and stored by the same
thread: the in-place shift needs no barrier. Nothing is read from the host: a CUDA graph
replays it with new slots and lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import (DTYPES, MAX_CONV_WIDTH, check_devices, check_state_step,
                                      interpreted)


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, pool_ptr, slot_ptr, fresh_ptr, y_ptr,
                        stride_xs, stride_wc, stride_pn, stride_pc, stride_pk, stride_ys, C,
                        K: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    slot = tl.load(slot_ptr + s).to(tl.int64)
    # A fresh sequence's past is zeros: no channel is read (folded into the integer bound, as
    # a scalar bool in a tensor mask is refused by newer Triton interpreters).
    live_c = tl.where(tl.load(fresh_ptr + s) != 0, 0, C)
    x_raw = tl.load(x_ptr + s * stride_xs + offs_c, mask=mask_c, other=0.0)
    row = pool_ptr + slot * stride_pn + offs_c.to(tl.int64) * stride_pc
    w_row = w_ptr + offs_c * stride_wc
    acc = tl.load(w_row + (K - 1), mask=mask_c, other=0.0).to(tl.float32) * x_raw.to(tl.float32)
    for j in tl.static_range(K - 1):
        past = tl.load(row + j * stride_pk, mask=offs_c < live_c, other=0.0)
        acc += tl.load(w_row + j, mask=mask_c, other=0.0).to(tl.float32) * past.to(tl.float32)
        if j > 0:  # the window moves on: column j becomes column j - 1
            tl.store(row + (j - 1) * stride_pk, past, mask=mask_c)
    tl.store(row + (K - 2) * stride_pk, x_raw.to(pool_ptr.dtype.element_ty), mask=mask_c)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + s * stride_ys + offs_c, acc.to(y_ptr.dtype.element_ty), mask=mask_c)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
INTERPRETED = interpreted(_conv_update_kernel)


def causal_conv_update_triton(x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor,
                              slots: torch.Tensor, fresh: torch.Tensor,
                              silu: bool = True) -> torch.Tensor:
    """One decode token per sequence through the causal conv, the pool updated in place.

    x: [S, C] (fp32/fp16/bf16, last dim contiguous, any row stride); weight: [C, K]
    (2 <= K <= ``MAX_CONV_WIDTH``, last dim contiguous); state_pool: [N, C, K - 1]
    (fp32/fp16/bf16, any strides); slots: [S] int64/int32; fresh: [S] bool. Returns y [S, C]
    in x's dtype (SiLU applied unless ``silu=False``)."""
    name = "causal_conv_update_triton"
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be [S, C] and weight "
                         f"{tuple(weight.shape)} [C, K]")
    s, c = x.shape
    kw = weight.shape[1]
    if not 2 <= kw <= MAX_CONV_WIDTH:
        raise ValueError(f"{name}: conv width {kw} outside [2, {MAX_CONV_WIDTH}]")
    check_state_step(name, state_pool, (c, kw - 1), slots, fresh, rows=s)
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"{name}: x {x.dtype} and weight {weight.dtype} must be in {DTYPES}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name}: x and weight need a contiguous last dim")
    check_devices(name, (x, weight, state_pool, slots, fresh), INTERPRETED,
                  "epserve.kernels.triton.causal_conv_update")
    y = torch.empty(s, c, dtype=x.dtype, device=x.device)
    if s == 0 or c == 0:
        return y
    bc = min(triton.next_power_of_2(c), 512)
    _conv_update_kernel[(s, triton.cdiv(c, bc))](
        x, weight, state_pool, slots.contiguous(), fresh.contiguous().view(torch.uint8), y,
        x.stride(0), weight.stride(0), state_pool.stride(0), state_pool.stride(1),
        state_pool.stride(2), y.stride(0), c,
        K=kw, BC=bc, SILU=silu, num_warps=4 if bc >= 256 else 2)
    return y
