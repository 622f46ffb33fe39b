"""Triton: a gated-DeltaNet layer's input projection at one row with the causal conv in the same
launch (contract: ``epserve.kernels.deltanet_proj``, the references).

``_in_proj_conv_kernel``: ``linear``'s GEMV (``default_gemv_tiles``: program ``p`` owns output
rows ``[p * BLOCK_N, +BLOCK_N)``) whose epilogue runs the causal-conv decode update on the rows
below C, which are conv channels: the projection rounded to its dtype (what ``linear``
returns) is the conv's input, read with the channel's last K - 1 inputs from the sequence's
slot (zeros when fresh: nothing read), the window shifted and stored back, SiLU applied, as
``causal_conv_update``'s kernel does; rows from C on are stored as projected. A channel
belongs to one program, but its value is replicated across that program's threads (the
GEMV's reduced layout), so the window is read whole, then moved, with a barrier between
every read and the store that overwrites it (without them fp32's tiles read moved columns).

It stores what the two launches it replaces store, but for the order of float32 sums.
CUDA-graph capturable (slots and the fresh flag read on the device).
Importing this module imports triton; kernels decorated while ``TRITON_INTERPRET=1`` is set
run in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import (DTYPES, MAX_CONV_WIDTH, check_devices, check_state_step,
                                      interpreted)
from epserve.kernels.triton.linear import default_gemv_tiles, gemv_block
from epserve.kernels.triton.pdl import pdl


@triton.jit
def _in_proj_conv_kernel(x_ptr, w_ptr, cw_ptr, pool_ptr, slot_ptr, fresh_ptr, out_ptr,
                         N, C, stride_wn, stride_cw, stride_pn, stride_pc, stride_pk,
                         K: tl.constexpr, KW: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    y = gemv_block(x_ptr, w_ptr, rows, N, stride_wn, K, BLOCK_N,  # the projection, as
                   BLOCK_K).to(out_ptr.dtype.element_ty)  # linear's
    # The conv update of the rows that are conv channels (causal_conv_update's kernel).
    conv = r_ok & (rows < C)
    slot = tl.load(slot_ptr).to(tl.int64)
    live_c = tl.where(tl.load(fresh_ptr) != 0, 0, C)  # a fresh sequence's past is zeros
    state = pool_ptr + slot * stride_pn + rows.to(tl.int64) * stride_pc
    cw_row = cw_ptr + rows * stride_cw
    live = conv & (rows < live_c)
    cacc = tl.load(cw_row + (KW - 1), mask=conv, other=0.0).to(tl.float32) * y.to(tl.float32)
    for j in tl.static_range(KW - 1):
        past = tl.load(state + j * stride_pk, mask=live, other=0.0)
        cacc += tl.load(cw_row + j, mask=conv, other=0.0).to(tl.float32) * past.to(tl.float32)
    # A row's value lives in several threads (the GEMV's reduced layout replicates it) and
    # one of them stores: every thread's reads of the window end before any of it moves.
    tl.debug_barrier()
    for j in tl.static_range(1, KW - 1):  # the window moves on: column j becomes column j - 1
        past = tl.load(state + j * stride_pk, mask=live, other=0.0)
        tl.debug_barrier()  # column j is read everywhere before column j + 1 lands on it
        tl.store(state + (j - 1) * stride_pk, past, mask=conv)
    tl.store(state + (KW - 2) * stride_pk, y.to(pool_ptr.dtype.element_ty), mask=conv)
    cacc = cacc * tl.sigmoid(cacc)
    out = tl.where(rows < C, cacc.to(out_ptr.dtype.element_ty), y)
    tl.store(out_ptr + rows, out, mask=r_ok)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
INTERPRETED = interpreted(_in_proj_conv_kernel)
_MODULE = "epserve.kernels.triton.deltanet_proj"


def in_proj_conv_triton(x: torch.Tensor, w_in: torch.Tensor, conv_weight: torch.Tensor,
                        state_pool: torch.Tensor, slots: torch.Tensor,
                        fresh: torch.Tensor) -> torch.Tensor:
    """``in_proj_conv_ref`` for one row in one launch: x [1, H], w_in [N, H] (one dtype of
    ``DTYPES``, last dims contiguous), conv_weight [C, K] (C <= N, 2 <= K <=
    ``MAX_CONV_WIDTH``), state_pool [N_slots, C, K - 1] (updated in place at ``slots[0]``),
    slots [1], fresh [1] bool. Returns a new [1, N]: the conv outputs, then the other
    columns."""
    name = "in_proj_conv_triton"
    if x.dim() != 2 or x.shape[0] != 1 or w_in.dim() != 2 or w_in.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be [1, H] and w_in "
                         f"{tuple(w_in.shape)} [N, H]")
    n, h = w_in.shape
    if conv_weight.dim() != 2 or not 2 <= conv_weight.shape[1] <= MAX_CONV_WIDTH \
            or conv_weight.shape[0] > n:
        raise ValueError(f"{name}: conv_weight {tuple(conv_weight.shape)} must be [C <= {n}, K] "
                         f"with 2 <= K <= {MAX_CONV_WIDTH}")
    c, kw = conv_weight.shape
    check_state_step(name, state_pool, (c, kw - 1), slots, fresh, rows=1)
    if x.dtype not in DTYPES or w_in.dtype != x.dtype or conv_weight.dtype not in DTYPES:
        raise ValueError(f"{name}: x {x.dtype}, w_in {w_in.dtype} (one of {DTYPES}) and "
                         f"conv_weight {conv_weight.dtype}")
    if any(t.stride(-1) != 1 for t in (x, w_in, conv_weight)):
        raise ValueError(f"{name}: x, w_in and conv_weight need a contiguous last dim")
    check_devices(name, (x, w_in, conv_weight, state_pool, slots, fresh), INTERPRETED, _MODULE)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0 or h == 0:
        return out
    bn, bk, nw, ns = default_gemv_tiles(n, h, x.element_size())
    _in_proj_conv_kernel[(triton.cdiv(n, bn),)](
        x, w_in, conv_weight, state_pool, slots, fresh.view(torch.uint8), out, n, c,
        w_in.stride(0), conv_weight.stride(0), state_pool.stride(0), state_pool.stride(1),
        state_pool.stride(2), K=h, KW=kw, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns,
        **pdl(_in_proj_conv_kernel))
    return out
