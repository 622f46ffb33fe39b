"""MoE router post-processing: softmax over the E experts, keep the top K, optionally renormalise.

Contract (``topk_softmax_ref`` is the definition):
logits [T, E] float32/float16/bfloat16 (the router matmul's output) ->
``(topk_ids [T, K] int64, topk_weights [T, K] float32)`` where
``probs = softmax(logits.float(), -1)``; row t's ids are the K largest probs in descending order,
EQUAL PROBS BREAKING TO THE LOWER EXPERT ID (``torch.topk`` leaves tie order unspecified, and on
CPU picks the higher id, so the reference uses a stable descending sort instead); the weights are
those probs, divided by their sum when ``renormalize``. NaN probs (a row with a NaN or +inf logit,
or all -inf) rank above every number, as in ``torch.sort``; such a row's weights are NaN and its
ids ``0..K-1``. ``topk_softmax`` runs one Triton launch (``epserve.kernels.triton.router``,
CUDA-graph capturable) where ``dispatch.use_triton`` says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels.dispatch import (DTYPES, MAX_FUSED_TOKENS, MAX_TRITON_EXPERTS,
                                      check_router_args, use_triton)
from epserve.kernels.norm import (fused_add_rms_norm, fused_add_rms_norm_ref,
                                  fused_add_zero_centred_rms_norm,
                                  fused_add_zero_centred_rms_norm_ref)

__all__ = ["MAX_FUSED_TOKENS", "MAX_TRITON_EXPERTS", "add_norm_router", "add_norm_router_ref",
           "check_router_args", "topk_softmax", "topk_softmax_ref"]


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


def topk_softmax(logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Public entry for ``topk_softmax_ref`` (same contract); checks args, picks the implementation.

    Runs ``topk_softmax_triton`` (one launch, no host sync) where ``dispatch.use_triton`` says
    so; the reference when the dtype is not float32/float16/bfloat16, or E > 512.
    """
    check_router_args("topk_softmax", logits, top_k)
    if logits.dtype in DTYPES and logits.shape[1] <= MAX_TRITON_EXPERTS and use_triton(logits):
        from epserve.kernels.triton.router import topk_softmax_triton

        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        return topk_softmax_triton(logits, top_k, renormalize)
    return topk_softmax_ref(logits, top_k, renormalize)


def add_norm_router_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, router_weight: torch.Tensor, top_k: int, renormalize: bool,
                        zero_centred: bool = False):
    """The MoE block's pre-norm and router, the definition of the fused launch:
    ``normed, new_residual = fused_add_rms_norm_ref(x, residual, norm_weight, eps)``
    (``fused_add_zero_centred_rms_norm_ref`` with ``zero_centred``: the hybrids), router
    logits ``F.linear(normed, router_weight)`` (x.dtype, as transformers' gate), then
    ``topk_softmax_ref``. Returns ``(normed, new_residual, topk_ids, topk_weights)``."""
    norm = fused_add_zero_centred_rms_norm_ref if zero_centred else fused_add_rms_norm_ref
    normed, new_res = norm(x, residual, norm_weight, eps)
    ids, weights = topk_softmax_ref(F.linear(normed, router_weight), top_k, renormalize)
    return normed, new_res, ids, weights


def add_norm_router(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, router_weight: torch.Tensor, top_k: int, renormalize: bool,
                    row_slots: torch.Tensor | None = None, zero_centred: bool = False):
    """Public entry for ``add_norm_router_ref`` (same contract). x, residual: [T, H];
    norm_weight: [H]; router_weight: [E, H]. ``row_slots`` ([T], each row's KV slot) marks
    padding rows (slot < 0): their routing is unspecified (their output is never read); the
    fused launch gives them no expert (ids -1, weights 0), which the fused MoE skips.
    ``zero_centred``: the hybrids' norm weight (``1 + w`` in float32).

    Up to ``MAX_FUSED_TOKENS`` rows where ``dispatch.use_triton`` says so it is one Triton
    launch (``epserve.kernels.triton.norm_router``: decode steps); larger batches, other dtypes
    or layouts run the three public entries it fuses (each row is normalised once there).
    """
    t = x.shape[0] if x.dim() == 2 else -1
    if (0 < t <= MAX_FUSED_TOKENS and x.dtype in DTYPES
            and residual.dtype == x.dtype == router_weight.dtype and residual.shape == x.shape
            and router_weight.shape[0] <= MAX_TRITON_EXPERTS
            and x.is_contiguous() and residual.is_contiguous() and use_triton(x)):
        from epserve.kernels.triton.norm_router import add_norm_router_triton

        return add_norm_router_triton(x, residual, norm_weight.contiguous(), eps,
                                      router_weight.contiguous(), top_k, renormalize,
                                      row_slots=row_slots, zero_centred=zero_centred)
    norm = fused_add_zero_centred_rms_norm if zero_centred else fused_add_rms_norm
    normed, new_res = norm(x, residual, norm_weight, eps)
    ids, weights = topk_softmax(F.linear(normed, router_weight), top_k, renormalize)
    return normed, new_res, ids, weights
