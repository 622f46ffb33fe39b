"""Dense projections without bias (``x @ w^T``), with a Triton GEMV for one-row decode steps.

Contract (``linear_ref`` is the definition): x [M, K], w [N, K], same float dtype -> [M, N] in
that dtype, accumulated in float32. Only the order of the float32 sum differs between paths.

Why a GEMV of our own: at one row the projection is pure weight streaming, and cuBLAS picked a
split-K kernel plus a reduce for it, slower than one pass over the weights (measured figures:
bench/RESULTS.md, "Kernel tuning history"). ``linear`` runs ``linear_gemv_triton`` for one-row
inputs where ``dispatch.use_triton`` says so, and ``torch.nn.functional.linear`` (cuBLAS)
otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels.dispatch import DTYPES, use_triton

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
