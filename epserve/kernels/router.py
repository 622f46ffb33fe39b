"""MoE router post-processing: softmax over the E experts, keep the top K, optionally renormalise.

Contract (``topk_softmax_ref`` is the definition):
logits [T, E] float32/float16/bfloat16 (the router matmul's output) ->
``(topk_ids [T, K] int64, topk_weights [T, K] float32)`` where
``probs = softmax(logits.float(), -1)``; row t's ids are the K largest probs in descending order,
EQUAL PROBS BREAKING TO THE LOWER EXPERT ID (``torch.topk`` leaves tie order unspecified, and on
CPU picks the higher id, so the reference uses a stable descending sort instead); the weights are
those probs, divided by their sum when ``renormalize``. NaN probs (a row with a NaN or +inf logit,
or all -inf) rank above every number, as in ``torch.sort``; such a row's weights are NaN and its
ids ``0..K-1``. ``topk_softmax`` runs one Triton launch for CUDA tensors (CUDA-graph capturable).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

#: The most rows the fused norm + router launch takes (each program re-normalises its row).
MAX_FUSED_TOKENS = 64
MAX_TRITON_EXPERTS = 512  # one [rows, next_pow2(E)] register tile per program; beyond: reference


def topk_softmax_ref(logits: torch.Tensor, top_k: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch definition (see the module docstring). logits: [T, E] float.

    Returns topk_ids [T, K] int64 and topk_weights [T, K] float32. Equals today's
    ``softmax -> torch.topk -> renormalise`` except that ties go to the lower expert id.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E] float32
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)  # stable: ties by id
    weights, ids = weights[:, :top_k], ids[:, :top_k]  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def check_router_args(name: str, logits: torch.Tensor, top_k: int) -> None:
    """Raise ValueError unless logits is a 2-D float tensor [T, E] and ``1 <= top_k <= E``."""
    if logits.dim() != 2:
        raise ValueError(f"{name}: logits must be 2-D [T, E], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"{name}: logits must be floating point, got {logits.dtype}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"{name}: top_k must be an int, got {top_k!r}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"{name}: top_k must be in [1, E={logits.shape[1]}], got {top_k}")


def topk_softmax(logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Public entry for ``topk_softmax_ref`` (same contract); checks args, picks the implementation.

    Runs ``topk_softmax_triton`` (one launch, no host sync) for CUDA tensors, or anywhere when
    ``TRITON_INTERPRET=1`` (the Triton interpreter, for CPU tests); falls back to the reference
    when triton is missing, the dtype is not float32/float16/bfloat16, or E > 512.
    """
    check_router_args("topk_softmax", logits, top_k)
    if ((logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and logits.shape[1] <= MAX_TRITON_EXPERTS):
        try:  # lazy: triton is optional; without it every device runs the reference
            from epserve.kernels.router_triton import topk_softmax_triton
        except ImportError:
            topk_softmax_triton = None
        if topk_softmax_triton is not None:
            if logits.stride(-1) != 1:
                logits = logits.contiguous()
            return topk_softmax_triton(logits, top_k, renormalize)
    return topk_softmax_ref(logits, top_k, renormalize)


def add_norm_router_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, router_weight: torch.Tensor, top_k: int, renormalize: bool):
    """The MoE block's pre-norm and router, the definition of the fused launch:
    ``normed, new_residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)``, router
    logits ``F.linear(normed, router_weight)`` (x.dtype, as transformers' gate), then
    ``topk_softmax_ref``. Returns ``(normed, new_residual, topk_ids, topk_weights)``."""
    from epserve.kernels.norm import fused_add_rms_norm_ref

    normed, new_res = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    ids, weights = topk_softmax_ref(F.linear(normed, router_weight), top_k, renormalize)
    return normed, new_res, ids, weights


def add_norm_router(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, router_weight: torch.Tensor, top_k: int, renormalize: bool,
                    row_slots: torch.Tensor | None = None):
    """Public entry for ``add_norm_router_ref`` (same contract). x, residual: [T, H];
    norm_weight: [H]; router_weight: [E, H]. ``row_slots`` ([T], each row's KV slot) marks
    padding rows (slot < 0): their routing is unspecified (their output is never read); the
    fused launch gives them no expert (ids -1, weights 0), which the fused MoE skips.

    Up to ``MAX_FUSED_TOKENS`` rows on CUDA (or under ``TRITON_INTERPRET=1``) it is one
    Triton launch (``norm_router_triton``: decode steps); larger batches, other dtypes or
    layouts run the three public entries it fuses (each row is normalised once there).
    """
    from epserve.kernels.norm import fused_add_rms_norm

    t = x.shape[0] if x.dim() == 2 else -1
    if (0 < t <= MAX_FUSED_TOKENS and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and residual.dtype == x.dtype == router_weight.dtype and residual.shape == x.shape
            and router_weight.shape[0] <= MAX_TRITON_EXPERTS
            and x.is_contiguous() and residual.is_contiguous()):
        try:  # lazy: triton is optional
            from epserve.kernels.norm_router_triton import add_norm_router_triton
        except ImportError:
            add_norm_router_triton = None
        if add_norm_router_triton is not None:
            return add_norm_router_triton(x, residual, norm_weight.contiguous(), eps,
                                          router_weight.contiguous(), top_k, renormalize,
                                          row_slots=row_slots)
    normed, new_res = fused_add_rms_norm(x, residual, norm_weight, eps)
    ids, weights = topk_softmax(F.linear(normed, router_weight), top_k, renormalize)
    return normed, new_res, ids, weights
