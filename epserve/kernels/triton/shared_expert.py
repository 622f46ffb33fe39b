"""Triton gated shared expert: for one row two launches instead of three GEMVs and five
elementwise ops; for more rows the elementwise ops as two launches between the projections.

Same contract as ``epserve.kernels.shared_expert.shared_expert_ref`` (the definition) for
``T == 1``:

1. ``_gate_up_gate_kernel``: one GEMV over two weights, ``[g, u, logit] = x @ [w_gate_up;
   w_gate]^T`` into one [2I + 1] buffer (the programs past w_gate_up's rows read w_gate's row:
   no weight is copied or concatenated), each output rounded to x's dtype as ``linear``'s.
2. ``_swiglu_down_kernel``: the down GEMV whose prologue forms ``silu(g) * u`` chunk by chunk
   (each rounded to the dtype, as the eager ``silu`` then ``mul``) and whose epilogue is
   ``routed + sigmoid(logit) * y`` (``y``, the sigmoid and the product each rounded, then the
   sum), as the eager ``sigmoid``, ``mul`` and ``add``. ``shared_expert_pairs_triton`` gives
   ``routed`` as the fused MoE's pair rows: the epilogue sums them first
   (``fused_moe.combine_pairs_block``, rounded as the combine's launch stores it), so a batch-1
   MoE layer needs no combine launch.

More rows (the projections through ``linear``, i.e. cuBLAS): ``swiglu_triton`` (``silu(g) *
u``) and ``gate_add_triton`` (``routed + sigmoid(logit) * y``), one program per row and column
block, each rounding where the eager ops round.

Layout as ``linear``'s GEMV (``default_gemv_tiles``): program ``p`` owns output rows ``[p *
BLOCK_N, +BLOCK_N)`` and walks K in ``BLOCK_K`` steps in a float32 [BLOCK_N, BLOCK_K] tile,
reduced once. Only the order of the float32 sums differs from the eager ops: float32 agrees to
~1e-6 relative, half precision to one unit in the last place of a rounding point.

CUDA-graph capturable (no host syncs; outputs allocated from shapes). Importing this module
imports triton; kernels decorated while ``TRITON_INTERPRET=1`` is set run in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import DTYPES, check_devices, interpreted
from epserve.kernels.triton.fused_moe import combine_pairs_block
from epserve.kernels.triton.linear import default_gemv_tiles, gemv_block
from epserve.kernels.triton.pdl import pdl


@triton.jit
def _gemv_rows(x_ptr, w_ptr, out_ptr, row0, N, stride_wn,
               K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[r] = w[r] . x`` for rows ``[row0, row0 + BLOCK_N)`` below N (rounded to out's
    dtype)."""
    rows = row0 + tl.arange(0, BLOCK_N)
    out = gemv_block(x_ptr, w_ptr, rows, N, stride_wn, K, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _gate_up_gate_kernel(x_ptr, wa_ptr, wb_ptr, out_ptr, NA, NB, stride_wa, stride_wb,
                         K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    """Output rows [0, NA) from ``wa`` (gate_up), [NA, NA + NB) from ``wb`` (the gate)."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    blocks_a = tl.cdiv(NA, BLOCK_N)
    if pid < blocks_a:
        _gemv_rows(x_ptr, wa_ptr, out_ptr, pid * BLOCK_N, NA, stride_wa, K, BLOCK_N, BLOCK_K)
    else:
        _gemv_rows(x_ptr, wb_ptr, out_ptr + NA, (pid - blocks_a) * BLOCK_N, NB, stride_wb, K,
                   BLOCK_N, BLOCK_K)


@triton.jit
def _swiglu_down_kernel(gu_ptr, w_ptr, routed_ptr, ids_ptr, out_ptr, N, stride_wn, num_local,
                        expert_offset, I: tl.constexpr, PAIRS: tl.constexpr,
                        TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
    """``out = routed + sigmoid(gu[2I]) * (w @ (silu(gu[:I]) * gu[I:2I]))`` over rows
    ``[pid * BLOCK_N, +BLOCK_N)``, rounded to out's dtype where the eager ops round. ``routed``
    is a row [N], or with PAIRS the token's TOP_K pair rows [TOP_K, N], those whose ``ids``
    name a local expert summed in float32 and rounded as ``combine_pairs_triton`` stores them."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        c_ok = cols < I
        g = tl.load(gu_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + I + cols, mask=c_ok, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # silu as torch writes it
        act = (silu * u).to(dt).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=r_ok[:, None] & c_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * act[None, :]
    y = tl.sum(acc, axis=1).to(dt).to(tl.float32)
    logit = tl.load(gu_ptr + 2 * I).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-logit))).to(dt).to(tl.float32)  # sigmoid as torch writes it
    if PAIRS:  # the routed combine, rounded where its launch would store it
        r = combine_pairs_block(routed_ptr, ids_ptr, 0, rows, N, num_local, expert_offset,
                                TOP_K).to(dt).to(tl.float32)
    else:
        r = tl.load(routed_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
    out = r + (gate * y).to(dt).to(tl.float32)
    tl.store(out_ptr + rows, out.to(dt), mask=r_ok)


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, stride_g, stride_o, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row ``pid0``: ``silu(gu[:I]) * gu[I:2I]``, each op rounded to out's dtype."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + I + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(dt), mask=ok)


@triton.jit
def _gate_add_kernel(y_ptr, logit_ptr, routed_ptr, out_ptr, stride_y, stride_l, stride_r,
                     stride_o, H, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row ``pid0``: ``routed + sigmoid(logit) * y``, each op rounded to out's dtype."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    logit = tl.load(logit_ptr + row * stride_l).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-logit))).to(dt).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(routed_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (r + (gate * y).to(dt).to(tl.float32)).to(dt),
             mask=ok)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
INTERPRETED = interpreted(_swiglu_down_kernel)


def shared_expert_triton(x: torch.Tensor, routed: torch.Tensor, w_gate_up: torch.Tensor,
                         w_down: torch.Tensor, w_gate: torch.Tensor) -> torch.Tensor:
    """``shared_expert_ref`` for one row in two launches: x, routed [1, H]; w_gate_up [2I, H];
    w_down [H, I]; w_gate [1, H]; one dtype of ``DTYPES``, last dims contiguous (row strides
    free). Returns a new [1, H] tensor."""
    name = "shared_expert_triton"
    if x.dim() != 2 or x.shape[0] != 1 or routed.shape != x.shape:
        raise ValueError(f"{name}: x {tuple(x.shape)} and routed {tuple(routed.shape)} must "
                         f"be [1, H]")
    _check_one_row(name, x, routed, w_gate_up, w_down, w_gate)
    return _one_row(x, routed, None, w_gate_up, w_down, w_gate, 0, 0)


def shared_expert_pairs_triton(x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor,
                               w_gate_up: torch.Tensor, w_down: torch.Tensor,
                               w_gate: torch.Tensor, expert_offset: int,
                               num_local: int) -> torch.Tensor:
    """``shared_expert_triton`` with ``routed`` given as the token's routed pair rows, in the
    same two launches: y [K, H] contiguous (x's dtype), ids [1, K] int64 or int32; ``routed`` is
    then ``combine_pairs_triton(y, ids, expert_offset, num_local)``, which the down GEMV's
    epilogue computes itself (the same float32 sum, rounded to x's dtype). Returns [1, H]."""
    name = "shared_expert_pairs_triton"
    k = ids.shape[1] if ids.dim() == 2 else -1
    if x.dim() != 2 or x.shape[0] != 1 or ids.shape != (1, k) or y.shape != (k, x.shape[1]):
        raise ValueError(f"{name}: x {tuple(x.shape)}, y {tuple(y.shape)} and ids "
                         f"{tuple(ids.shape)} must be [1, H], [K, H] and [1, K]")
    if ids.dtype not in (torch.int64, torch.int32) or not (y.is_contiguous()
                                                          and ids.is_contiguous()):
        raise ValueError(f"{name}: y and ids must be contiguous, ids int64 or int32")
    _check_one_row(name, x, y, w_gate_up, w_down, w_gate, ids)
    return _one_row(x, y, ids, w_gate_up, w_down, w_gate, expert_offset, num_local)


def _check_one_row(name, x, routed, w_gate_up, w_down, w_gate, *others) -> None:
    """The weights' shapes, one dtype of ``DTYPES``, contiguous last dims, one device."""
    h = x.shape[1]
    i = w_down.shape[1] if w_down.dim() == 2 else -1
    if w_gate_up.shape != (2 * i, h) or w_down.shape != (h, i) or w_gate.shape != (1, h) \
            or i < 1:
        raise ValueError(f"{name}: w_gate_up {tuple(w_gate_up.shape)}, w_down "
                         f"{tuple(w_down.shape)}, w_gate {tuple(w_gate.shape)} must be "
                         f"[2I, {h}], [{h}, I], [1, {h}] with I >= 1")
    tensors = (x, routed, w_gate_up, w_down, w_gate)
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in tensors):
        raise ValueError(f"{name}: dtypes {[t.dtype for t in tensors]} must be one of {DTYPES}")
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"{name}: every tensor needs a contiguous last dim")
    check_devices(name, tensors + others, INTERPRETED, "epserve.kernels.triton.shared_expert")


def _one_row(x, routed, ids, w_gate_up, w_down, w_gate, expert_offset, num_local):
    """The two launches (checked inputs); ``ids`` None: ``routed`` is the [1, H] row, else the
    [K, H] pair rows."""
    h, i = x.shape[1], w_down.shape[1]
    gu = torch.empty((1, 2 * i + 1), dtype=x.dtype, device=x.device)  # [g, u, logit]
    out = torch.empty((1, h), dtype=x.dtype, device=x.device)
    if h == 0:
        return out
    bn, bk, nw, ns = default_gemv_tiles(2 * i + 1, h, x.element_size())
    _gate_up_gate_kernel[(triton.cdiv(2 * i, bn) + 1,)](
        x, w_gate_up, w_gate, gu, 2 * i, 1, w_gate_up.stride(0), w_gate.stride(0),
        K=h, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, **pdl(_gate_up_gate_kernel))
    bn, bk, nw, ns = default_gemv_tiles(h, i, x.element_size())
    _swiglu_down_kernel[(triton.cdiv(h, bn),)](
        gu, w_down, routed, routed if ids is None else ids, out, h, w_down.stride(0), num_local,
        expert_offset, I=i, PAIRS=ids is not None, TOP_K=0 if ids is None else ids.shape[1],
        BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, **pdl(_swiglu_down_kernel))
    return out


def _rows_check(name: str, tensors) -> None:
    if any(t.dim() != 2 or t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"{name}: 2-D tensors with a contiguous last dim, got "
                         f"{[tuple(t.shape) for t in tensors]}")
    if tensors[0].dtype not in DTYPES or any(t.dtype != tensors[0].dtype for t in tensors):
        raise ValueError(f"{name}: dtypes {[t.dtype for t in tensors]} must be one of {DTYPES}")
    check_devices(name, tensors, INTERPRETED, "epserve.kernels.triton.shared_expert")


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` in one launch, rounded as the two eager ops:
    gate_up [T, 2I] (last dim contiguous). Returns a new [T, I]."""
    _rows_check("swiglu_triton", (gate_up,))
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"swiglu_triton: gate_up {tuple(gate_up.shape)} must be [T, 2I]")
    out = torch.empty((t, two_i // 2), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(triton.next_power_of_2(two_i // 2), 1024)
        _swiglu_kernel[(t, triton.cdiv(two_i // 2, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), two_i // 2, BLOCK=block,
            num_warps=4, **pdl(_swiglu_kernel))
    return out


def gate_add_triton(y: torch.Tensor, logit: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """``routed + sigmoid(logit) * y`` in one launch, rounded as the three eager ops: y, routed
    [T, H], logit [T, 1] (one dtype, last dims contiguous). Returns a new [T, H]."""
    _rows_check("gate_add_triton", (y, logit, routed))
    t, h = y.shape
    if routed.shape != y.shape or logit.shape != (t, 1):
        raise ValueError(f"gate_add_triton: y {tuple(y.shape)}, routed {tuple(routed.shape)} "
                         f"must be [T, H] and logit {tuple(logit.shape)} [T, 1]")
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if out.numel():
        block = min(triton.next_power_of_2(h), 1024)
        _gate_add_kernel[(t, triton.cdiv(h, block))](
            y, logit, routed, out, y.stride(0), logit.stride(0), routed.stride(0), out.stride(0),
            h, BLOCK=block, num_warps=4, **pdl(_gate_add_kernel))
    return out
