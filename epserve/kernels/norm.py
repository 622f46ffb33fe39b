"""RMSNorm and fused residual-add + RMSNorm; refs are the definition.

Invariants: the mean square is taken in float32; the normalised value is cast back to the
input dtype before the weight multiply (as Hugging Face Llama/Qwen/Mixtral do), so fp32 runs
match transformers bit for bit in the ordinary case.

Two variants of the gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5): the zero-centred norm
(weights stored around 0, applied as ``1 + w`` in float32 with one cast at the end, as
transformers does; with a residual added first, as the plain fused one) and the gated output
norm of a DeltaNet layer (``rms_norm_ref`` times ``silu(gate)``, in float32).

Every public entry runs ``epserve.kernels.triton.norm`` (one launch, CUDA-graph capturable)
where ``dispatch.use_triton`` says so and the shape/dtype is one it covers (fp32/fp16/bf16,
``H <= 8192``); the reference otherwise. The zero-centred kernels add the 1 to the weight in
float32 inside the kernel: ``1 + w`` is never stored in the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels.dispatch import DTYPES, MAX_NORM_H, use_triton


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
    if _runs_triton(x, weight):
        from epserve.kernels.triton.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Public entry for ``fused_add_rms_norm_ref`` (same contract)."""
    if x.shape != residual.shape:
        raise ValueError(f"fused_add_rms_norm: x {tuple(x.shape)} != residual {tuple(residual.shape)}")
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"fused_add_rms_norm: x {tuple(x.shape)} last dim != weight "
                         f"{tuple(weight.shape)}")
    if residual.dtype == x.dtype and _runs_triton(x, weight):
        from epserve.kernels.triton.norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def _runs_triton(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The Triton kernel runs for these tensors: ``use_triton`` and a layout it covers."""
    if (weight.dim() != 1 or not 1 <= x.shape[-1] <= MAX_NORM_H or x.dtype not in DTYPES
            or weight.dtype not in DTYPES or weight.device != x.device):
        return False
    return use_triton(x)


def zero_centred_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; weight: [H] stored around 0. Returns [..., H] in x.dtype:
    ``(x / rms(x)) * (1 + weight)`` computed in float32 and cast once."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Public entry for ``zero_centred_rms_norm_ref`` (same contract)."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"zero_centred_rms_norm: x {tuple(x.shape)} last dim != weight "
                         f"{tuple(weight.shape)}")
    if _runs_triton(x, weight):
        from epserve.kernels.triton.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, zero_centred=True)
    return zero_centred_rms_norm_ref(x, weight, eps)


def fused_add_zero_centred_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor,
                                        weight: torch.Tensor, eps: float
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm_ref`` with the zero-centred norm: ``new_residual = x + residual``
    (x.dtype), ``normed = zero_centred_rms_norm_ref(new_residual)``; returns both."""
    new_residual = x + residual
    return zero_centred_rms_norm_ref(new_residual, weight, eps), new_residual


def fused_add_zero_centred_rms_norm(x: torch.Tensor, residual: torch.Tensor,
                                    weight: torch.Tensor, eps: float
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Public entry for ``fused_add_zero_centred_rms_norm_ref`` (same contract)."""
    if x.shape != residual.shape or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"fused_add_zero_centred_rms_norm: x {tuple(x.shape)}, residual "
                         f"{tuple(residual.shape)} and weight {tuple(weight.shape)} disagree")
    if residual.dtype == x.dtype and _runs_triton(x, weight):
        from epserve.kernels.triton.norm import fused_add_rms_norm_triton

        return fused_add_rms_norm_triton(x, residual, weight, eps, zero_centred=True)
    return fused_add_zero_centred_rms_norm_ref(x, residual, weight, eps)


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """x, gate: [..., D]; weight: [D]. Returns [..., D] in x.dtype:
    ``rms_norm_ref(x, weight, eps) * silu(gate)``, the product in float32."""
    return (rms_norm_ref(x, weight, eps) * F.silu(gate.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Public entry for ``gated_rms_norm_ref`` (same contract)."""
    if x.shape != gate.shape or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)} and "
                         f"weight {tuple(weight.shape)} disagree")
    if gate.dtype in DTYPES and gate.device == x.device and _runs_triton(x, weight):
        from epserve.kernels.triton.norm import gated_rms_norm_triton

        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate, weight, eps)
