"""Triton RMSNorm and fused residual-add + RMSNorm: one launch, one program per row; the
zero-centred and the gated variants of the gated-DeltaNet hybrids.

Same contracts as ``epserve.kernels.norm.rms_norm_ref`` / ``fused_add_rms_norm_ref`` (the
definitions); with ``zero_centred`` as ``zero_centred_rms_norm_ref`` (after the residual add
where there is one): the weight is stored around 0 and the kernel applies ``1 + w`` in float32
(never rounded to the weight's dtype: near 1, bf16 would lose a w of ~0.01), the normalised
value times it cast once. ``gated_rms_norm_triton`` is ``gated_rms_norm_ref``: the plain norm
(rounded as below) times ``silu(gate)`` in float32, one program per (row, head) of
[A, B, D] views, so a gate sliced out of a wider projection is read through its strides. Rows are the flattened leading dims of ``x``; ``H`` (the last dim) is at most
``MAX_H`` and is covered by one block of ``next_power_of_2(H)`` lanes. Rounding follows the refs:
``new_residual = x + residual`` is rounded to x.dtype first (the sum is what gets normalised);
the mean square and the scaling run in float32; the normalised value is cast to x.dtype BEFORE
the weight multiply (float32), whose product is cast to x.dtype again. Only the order of the
float32 sum of squares differs from torch, so fp32 agrees to ~1e-6 relative and half precision
to one unit in the last place.

CUDA-graph capturable: no host syncs; outputs are allocated from shapes only. Importing this
module imports triton; kernels decorated while ``TRITON_INTERPRET=1`` is set run in the Triton
interpreter (CPU tensors allowed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.dispatch import DTYPES, MAX_NORM_H, check_devices, interpreted
from epserve.kernels.triton.pdl import pdl

MAX_H = MAX_NORM_H


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_r, stride_out, stride_res_out, H, eps,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, ZERO_CENTRED: tl.constexpr,
                     PDL: tl.constexpr):
    """Row ``pid``: optionally ``s = x + r`` (stored, x.dtype), then ``w * rms_normalise(s)``
    (``(1 + w) * ...`` in float32 when ZERO_CENTRED)."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded as torch's x + residual
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:  # float32 throughout, one cast
        out = (xf * tl.rsqrt(mean_sq + eps)) * (1.0 + w)
    else:
        normed = (xf * tl.rsqrt(mean_sq + eps)).to(dtype)  # cast before the weight multiply
        out = w * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(dtype), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, stride_xa, stride_xb, stride_za,
                           stride_zb, stride_oa, stride_ob, D, eps, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    """Row (a, b) of [A, B, D]: ``rms_norm_ref(x) * silu(z)``, the product in float32."""
    if PDL:  # before any load or store (pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / D
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(dtype)  # rounded as rms_norm_ref
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed.to(tl.float32)).to(dtype).to(tl.float32)
    z = tl.load(z_ptr + a * stride_za + b * stride_zb + offs, mask=mask, other=0.0).to(tl.float32)
    out = y * (z / (1.0 + tl.exp(-z)))  # silu as torch writes it
    tl.store(out_ptr + a * stride_oa + b * stride_ob + offs, out.to(dtype), mask=mask)


# triton.jit picks the interpreter from TRITON_INTERPRET when this module is imported.
INTERPRETED = interpreted(_rms_norm_kernel)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [N, H] with a contiguous last dim (a view when the strides allow it)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _check(name: str, x: torch.Tensor, weight: torch.Tensor,
           residual: torch.Tensor | None = None) -> None:
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be [..., H] and weight "
                         f"{tuple(weight.shape)} [H]")
    h = x.shape[-1]
    if not 1 <= h <= MAX_H:
        raise ValueError(f"{name}: hidden size {h} outside [1, {MAX_H}]")
    if x.dtype not in DTYPES or weight.dtype not in DTYPES:
        raise ValueError(f"{name}: x {x.dtype} and weight {weight.dtype} must be in {DTYPES}")
    tensors = [x, weight]
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"{name}: residual {tuple(residual.shape)} {residual.dtype} must "
                             f"match x {tuple(x.shape)} {x.dtype}")
        tensors.append(residual)
    check_devices(name, tensors, INTERPRETED, "epserve.kernels.triton.norm")


def _warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def _launch(x2, r2, weight, out2, res2, eps: float, zero_centred: bool = False) -> None:
    h = x2.shape[1]
    block = triton.next_power_of_2(h)
    num_warps = _warps(block)
    has_res = r2 is not None
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2 if has_res else x2, weight, out2, res2 if has_res else out2,
        x2.stride(0), r2.stride(0) if has_res else 0, out2.stride(0),
        res2.stride(0) if has_res else 0, h, float(eps),
        BLOCK=block, HAS_RES=has_res, ZERO_CENTRED=zero_centred, num_warps=num_warps,
        **pdl(_rms_norm_kernel))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    zero_centred: bool = False) -> torch.Tensor:
    """Triton ``rms_norm_ref`` (``zero_centred_rms_norm_ref`` with ``zero_centred``): x [..., H]
    (fp32/fp16/bf16), weight [H]. Returns [..., H] x.dtype.

    x may be any strided tensor (the leading dims are flattened; a copy only when they cannot
    be viewed as rows); the result is a new contiguous tensor.
    """
    _check("rms_norm_triton", x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _launch(_rows(x), None, weight.contiguous(), out.view(-1, x.shape[-1]), None, eps,
            zero_centred)
    return out


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float, zero_centred: bool = False
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``fused_add_rms_norm_ref`` (``fused_add_zero_centred_rms_norm_ref`` with
    ``zero_centred``): returns ``(normed, new_residual)``, [..., H] x.dtype.

    x, residual: [..., H], same shape and dtype; weight: [H]. Both results are new contiguous
    tensors; the inputs are not modified.
    """
    _check("fused_add_rms_norm_triton", x, weight, residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out, new_res
    h = x.shape[-1]
    _launch(_rows(x), _rows(residual), weight.contiguous(), out.view(-1, h), new_res.view(-1, h),
            eps, zero_centred)
    return out, new_res


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[..., B, D] -> [A, B, D] (a view where the strides allow, [N, D] as [N, 1, D]), last dim
    contiguous."""
    if t.dim() == 1:
        t = t.view(1, 1, -1)
    elif t.dim() == 2:
        t = t.unsqueeze(1)
    elif t.dim() > 3:
        t = t.reshape(-1, *t.shape[-2:])
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> torch.Tensor:
    """Triton ``gated_rms_norm_ref``: x, gate [..., D] (each fp32/fp16/bf16, any strides: a
    gate sliced out of a projection is read in place), weight [D]. Returns a new contiguous
    [..., D] in x.dtype."""
    name = "gated_rms_norm_triton"
    _check(name, x, weight)
    if gate.shape != x.shape or gate.dtype not in DTYPES:
        raise ValueError(f"{name}: gate {tuple(gate.shape)} {gate.dtype} must be "
                         f"{tuple(x.shape)} in {DTYPES}")
    check_devices(name, (x, gate, weight), INTERPRETED, "epserve.kernels.triton.norm")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x3, z3, o3 = _as_3d(x), _as_3d(gate), out.view(_as_3d(x).shape)
    a, b, d = x3.shape
    if b > 65535:  # grid axis 1
        x3, z3, o3 = (t.reshape(a * b, 1, d) for t in (x3, z3, o3))
        a, b = a * b, 1
    block = triton.next_power_of_2(d)
    _gated_rms_norm_kernel[(a, b)](
        x3, z3, weight.contiguous(), o3, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1),
        o3.stride(0), o3.stride(1), d, float(eps), BLOCK=block, num_warps=_warps(block),
        **pdl(_gated_rms_norm_kernel))
    return out
