"""Triton RMSNorm and fused residual-add + RMSNorm: one launch, one program per row.

Same contracts as ``epserve.kernels.norm.rms_norm_ref`` / ``fused_add_rms_norm_ref`` (the
definitions). Rows are the flattened leading dims of ``x``; ``H`` (the last dim) is at most
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

MAX_H = MAX_NORM_H


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_r, stride_out, stride_res_out, H, eps,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    """Row ``pid``: optionally ``s = x + r`` (stored, x.dtype), then ``w * rms_normalise(s)``."""
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
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(dtype)  # cast before the weight multiply
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (w * normed.to(tl.float32)).to(dtype), mask=mask)


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


def _launch(x2, r2, weight, out2, res2, eps: float) -> None:
    h = x2.shape[1]
    block = triton.next_power_of_2(h)
    num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    has_res = r2 is not None
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2 if has_res else x2, weight, out2, res2 if has_res else out2,
        x2.stride(0), r2.stride(0) if has_res else 0, out2.stride(0),
        res2.stride(0) if has_res else 0, h, float(eps),
        BLOCK=block, HAS_RES=has_res, num_warps=num_warps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton ``rms_norm_ref``: x [..., H] (fp32/fp16/bf16), weight [H]. Returns [..., H] x.dtype.

    x may be any strided tensor (the leading dims are flattened; a copy only when they cannot
    be viewed as rows); the result is a new contiguous tensor.
    """
    _check("rms_norm_triton", x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    _launch(_rows(x), None, weight.contiguous(), out.view(-1, x.shape[-1]), None, eps)
    return out


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``fused_add_rms_norm_ref``: returns ``(normed, new_residual)``, [..., H] x.dtype.

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
            eps)
    return out, new_res
