"""RMSNorm and fused residual-add + RMSNorm; refs are the definition.

Invariants: the mean square is taken in float32; the normalised value is cast back to the
input dtype before the weight multiply (as Hugging Face Llama/Qwen/Mixtral do), so fp32 runs
match transformers bit for bit in the ordinary case.

The public entries run ``epserve.kernels.norm_triton`` (one launch, CUDA-graph capturable) for
CUDA tensors, or anywhere while ``TRITON_INTERPRET=1`` (CPU tests), when triton imports and the
shape/dtype is one it covers (fp32/fp16/bf16, ``H <= 8192``); the reference otherwise.
"""

from __future__ import annotations

import importlib
import os

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; weight: [H]. Returns [..., H] in x.dtype: ``weight * x / rms(x)``."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the residual stream, then normalise the sum.

    x, residual: [..., H]; weight: [H]. Returns ``(normed, new_residual)``, both [..., H]
    x.dtype, where ``new_residual = x + residual`` and ``normed = rms_norm(new_residual)``.
    """
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Public entry for ``rms_norm_ref`` (same contract)."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} last dim != weight {tuple(weight.shape)}")
    triton_mod = _triton_module(x, weight)
    if triton_mod is not None:
        return triton_mod.rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Public entry for ``fused_add_rms_norm_ref`` (same contract)."""
    if x.shape != residual.shape:
        raise ValueError(f"fused_add_rms_norm: x {tuple(x.shape)} != residual {tuple(residual.shape)}")
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"fused_add_rms_norm: x {tuple(x.shape)} last dim != weight "
                         f"{tuple(weight.shape)}")
    triton_mod = _triton_module(x, weight) if residual.dtype == x.dtype else None
    if triton_mod is not None:
        return triton_mod.fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _triton_module(x: torch.Tensor, weight: torch.Tensor):
    """``epserve.kernels.norm_triton`` when it should run for these tensors, else None."""
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    if (weight.dim() != 1 or not 1 <= x.shape[-1] <= 8192 or x.dtype not in _TRITON_DTYPES
            or weight.dtype not in _TRITON_DTYPES or weight.device != x.device):
        return None
    try:  # lazy: triton is optional; without it every device runs the reference
        # By module name (sys.modules), not as a package attribute: tests drop interpreted copies.
        return importlib.import_module("epserve.kernels.norm_triton")
    except ImportError:
        return None
