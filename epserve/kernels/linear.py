"""Dense projections without bias (``x @ w^T``), with a Triton GEMV for one-row decode steps.

Contract (``linear_ref`` is the definition): x [M, K], w [N, K], same float dtype -> [M, N] in
that dtype, accumulated in float32. Only the order of the float32 sum differs between paths.

Why a GEMV of our own: at one row, cuBLAS picked a split-K kernel plus a reduce for the
attention output projection (~9 us for 16.8 MB on the H200, ~1.9 TB/s, session-3 profile) and
~7.7 us for the 21 MB qkv projection; the row is pure weight streaming. ``linear`` runs
``linear_triton`` for one-row CUDA inputs (or anywhere under ``TRITON_INTERPRET=1``) and
``torch.nn.functional.linear`` (cuBLAS) otherwise.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

#: Rows up to which the Triton GEMV runs (each row would stream the weights again above).
GEMV_MAX_ROWS = 1


def linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; w: [N, K]. Returns [M, N] x.dtype (float32 accumulation)."""
    return (x.float() @ w.float().t()).to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Public entry for ``linear_ref`` (same contract): x [M, K] (or [..., K] for cuBLAS)."""
    if (x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.shape[0] > 0
            and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and x.dtype == w.dtype and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and w.is_contiguous() and x.stride(-1) == 1):
        try:  # lazy: triton is optional
            from epserve.kernels.linear_triton import linear_gemv_triton
        except ImportError:
            linear_gemv_triton = None
        if linear_gemv_triton is not None:
            return linear_gemv_triton(x, w)
    return F.linear(x, w)
