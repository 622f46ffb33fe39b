"""Dense projections without bias (``x @ w^T``), with a Triton GEMV for one-row decode steps.

Contract (``linear_ref`` is the definition): x [M, K], w [N, K], same float dtype -> [M, N] in
that dtype, accumulated in float32. Only the order of the float32 sum differs between paths.

Why a GEMV of our own: at one row the projection is pure weight streaming, and cuBLAS picked a
split-K kernel plus a reduce for it, slower than one pass over the weights (measured figures:
bench/RESULTS.md, "Kernel tuning history"). ``linear`` runs ``linear_gemv_triton`` for one-row
inputs where ``dispatch.use_triton`` says so, and ``torch.nn.functional.linear`` (cuBLAS)
otherwise. ``add_norm_linear`` is a block's zero-centred input norm (the residual added
first) and then ``linear``: one launch at one row on the Triton path (the GEMV's prologue
normalises the row; ``zc_norm_gemv_block``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels.dispatch import DTYPES, MAX_NORM_H, use_triton
from epserve.kernels.norm import fused_add_zero_centred_rms_norm, zero_centred_rms_norm

#: Rows up to which the Triton GEMV runs (each row would stream the weights again above).
GEMV_MAX_ROWS = 1


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; w: [N, K]. Returns [M, N] x.dtype (float32 accumulation)."""
    return (x.float() @ w.float().t()).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Public entry for ``linear_ref`` (same contract): x [M, K] (or [..., K] for cuBLAS)."""
    if (x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.shape[0] > 0
            and x.dtype == w.dtype and x.dtype in DTYPES
            and w.is_contiguous() and x.stride(-1) == 1 and use_triton(x)):
        from epserve.kernels.triton.linear import linear_gemv_triton

        return linear_gemv_triton(x, w)
    return F.linear(x, w)


def add_norm_linear(hidden: torch.Tensor, residual: torch.Tensor | None,
                    norm_weight: torch.Tensor, eps: float,
                    w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual = fused_add_zero_centred_rms_norm(hidden, residual, norm_weight, eps)``
    (without a residual: ``zero_centred_rms_norm(hidden)``, ``hidden`` the residual), then
    ``linear(x, w)``. Returns ``(linear output, residual)``."""
    if (hidden.dim() == 2 and hidden.shape[0] == 1 and hidden.shape[1] <= MAX_NORM_H
            and hidden.dtype == w.dtype and hidden.dtype in DTYPES
            and norm_weight.dtype in DTYPES and w.is_contiguous() and hidden.stride(-1) == 1
            and (residual is None or (residual.dtype == hidden.dtype
                                      and residual.shape == hidden.shape
                                      and residual.stride(-1) == 1))
            and use_triton(hidden)):
        from epserve.kernels.triton.linear import add_norm_gemv_triton

        return add_norm_gemv_triton(hidden, residual, norm_weight, eps, w)
    if residual is None:
        x, residual = zero_centred_rms_norm(hidden, norm_weight, eps), hidden
    else:
        x, residual = fused_add_zero_centred_rms_norm(hidden, residual, norm_weight, eps)
    return linear(x, w), residual
