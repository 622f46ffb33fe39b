"""Fused MoE expert compute (SwiGLU experts, top-k weighted sum) over a shard of stacked experts.

Invariants: ``w13[e]`` holds expert ``expert_offset + e``'s gate rows then its up rows; a
token's routed expert outside ``[expert_offset, expert_offset + E)`` contributes zero, so the
sum over all shards' outputs is the full MoE output. Accumulation is in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels.dispatch import use_triton


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """Weighted sum of each token's routed SwiGLU experts that this shard holds.

    x: [T, H]; w13: [E, 2I, H] (gate rows first, then up); w2: [E, H, I];
    topk_ids: [T, K] int64 global expert ids; topk_weights: [T, K] float32.
    Returns [T, H] x.dtype: ``sum_k w_k * w2[e_k] @ (silu(gate_k) * up_k)`` over local experts.
    """
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local_ids = topk_ids - expert_offset  # [T, K]
    present = local_ids[(local_ids >= 0) & (local_ids < num_local)]
    for e in torch.unique(present).tolist():
        token_idx, k_idx = torch.nonzero(local_ids == e, as_tuple=True)  # [n], [n]
        gate_up = x[token_idx] @ w13[e].t()  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        y = (act @ w2[e].t()).float()  # [n, H]
        out.index_add_(0, token_idx, y * topk_weights[token_idx, k_idx, None].float())
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """Public entry for ``fused_moe_ref`` (same contract); checks shapes, picks the implementation.

    Runs ``fused_moe_triton`` (``epserve.kernels.triton.fused_moe``) where
    ``dispatch.use_triton`` says so, the reference otherwise.

    x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; topk_ids: [T, K] int64; topk_weights: [T, K]
    float32. Returns [T, H] x.dtype.
    """
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 "
                         f"{tuple(w2.shape)} must be [T, H], [E, 2I, H], [E, H, I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"fused_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{t}, K]")
    if use_triton(x):
        from epserve.kernels.triton.fused_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_ids, topk_weights, expert_offset)
    return fused_moe_ref(x, w13, w2, topk_ids, topk_weights, expert_offset)
