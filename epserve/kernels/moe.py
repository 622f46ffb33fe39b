"""Fused MoE expert compute (SwiGLU experts, top-k weighted sum) over a shard of stacked experts.

Invariants: ``w13[e]`` holds expert ``expert_offset + e``'s gate rows then its up rows; a
token's routed expert outside ``[expert_offset, expert_offset + E)`` contributes zero, so the
sum over all shards' outputs is the full MoE output. Accumulation is in float32.

``fused_moe`` is the entry (``fused_moe_ref`` the definition). ``fused_moe_pairs`` stops
before the last step of the Triton pipeline, the combine of each token's K pair rows: it hands
them on as ``RoutedPairs`` for a consumer that sums them in its own launch (the hybrids' shared
expert at one row, ``shared_expert_add``); ``combine_pairs`` is that sum alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epserve.kernels.dispatch import DTYPES, use_triton


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
    _check("fused_moe", x, w13, w2, topk_ids, topk_weights)
    if use_triton(x):
        from epserve.kernels.triton.fused_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_ids, topk_weights, expert_offset)
    return fused_moe_ref(x, w13, w2, topk_ids, topk_weights, expert_offset)


@dataclass(frozen=True)
class RoutedPairs:
    """The routed experts' output before the combine, one row per (token, k) pair.

    y: [T * K, H], contiguous: row ``t * K + k`` is ``topk_weights[t, k] * expert(x[t])`` in
    x's dtype, for the pairs whose id in ids: [T, K] (int64 or int32, contiguous, global expert
    ids) is local, i.e. in ``[expert_offset, expert_offset + num_local)``; the other rows hold
    anything and are never read. ``combine_pairs`` of it is the routed output [T, H].
    """

    y: torch.Tensor
    ids: torch.Tensor
    expert_offset: int
    num_local: int

    def __post_init__(self) -> None:
        y, ids = self.y, self.ids
        if y.dim() != 2 or ids.dim() != 2 or y.shape[0] != ids.numel():
            raise ValueError(f"RoutedPairs: y {tuple(y.shape)} and ids {tuple(ids.shape)} must "
                             f"be [T * K, H] and [T, K]")
        if ids.dtype not in (torch.int64, torch.int32) or not y.is_floating_point():
            raise ValueError(f"RoutedPairs: ids {ids.dtype} must be int64 or int32, y "
                             f"{y.dtype} floating")
        if not (y.is_contiguous() and ids.is_contiguous()) or y.device != ids.device:
            raise ValueError("RoutedPairs: y and ids must be contiguous, on one device")


def combine_pairs_ref(pairs: RoutedPairs) -> torch.Tensor:
    """The routed output of ``pairs``: ``out[t] = sum over k of y[t * K + k]`` over its local
    pairs, in float32 (k ascending), rounded to y's dtype. Returns [T, H]."""
    (t, k), h = pairs.ids.shape, pairs.y.shape[1]
    local = (pairs.ids >= pairs.expert_offset) & (pairs.ids < pairs.expert_offset
                                                  + pairs.num_local)  # [T, K]
    y = pairs.y.view(t, k, h)
    out = torch.zeros((t, h), dtype=torch.float32, device=y.device)
    for j in range(k):  # one add per pair, in the kernel's order
        out += torch.where(local[:, j, None], y[:, j].float(), 0.0)
    return out.to(pairs.y.dtype)


def combine_pairs(pairs: RoutedPairs) -> torch.Tensor:
    """Public entry for ``combine_pairs_ref`` (same contract, the same float32 sums): one
    launch (``combine_pairs_triton``) where ``dispatch.use_triton`` says so."""
    if use_triton(pairs.y) and pairs.y.dtype in DTYPES:
        from epserve.kernels.triton.fused_moe import combine_pairs_triton

        return combine_pairs_triton(pairs.y, pairs.ids, pairs.expert_offset, pairs.num_local)
    return combine_pairs_ref(pairs)


def fused_moe_pairs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    expert_offset: int = 0) -> torch.Tensor | RoutedPairs:
    """``fused_moe`` (same arguments) for a caller that combines the pairs itself: where the
    Triton pipeline runs, its pair rows as ``RoutedPairs`` (``combine_pairs`` of them is
    ``fused_moe``'s output, bit for bit); elsewhere ``fused_moe_ref``'s [T, H] output."""
    _check("fused_moe_pairs", x, w13, w2, topk_ids, topk_weights)
    if not use_triton(x):
        return fused_moe_ref(x, w13, w2, topk_ids, topk_weights, expert_offset)
    from epserve.kernels.triton.fused_moe import fused_moe_pairs_triton

    y, ids = fused_moe_pairs_triton(x, w13, w2, topk_ids, topk_weights, expert_offset)
    return RoutedPairs(y, ids, expert_offset, w13.shape[0])


def token_classes(max_tokens: int, top_k: int, w13: torch.Tensor) -> list[int]:
    """The smallest token count of each launch class (``launch_class``) that the Triton
    pipeline has for steps of 1 .. ``max_tokens`` tokens routed to ``top_k`` of ``w13``'s
    experts ([E, 2I, H]), ascending. A forward at each compiles every kernel variant the
    routed experts of such a step can launch (the start-up warm-up, ``worker.warmup``).
    Each class is one run of token counts (tiles and layout rise with the pairs), so each
    run's end is found by bisection."""
    from epserve.kernels.triton.fused_moe import launch_class

    e, two_i, h = w13.shape

    def cls(t: int) -> tuple:
        return launch_class(t * top_k, e, h, two_i // 2, w13.element_size())

    out, t = [], 1
    while t <= max_tokens:
        out.append(t)
        here, lo, hi = cls(t), t, max_tokens  # the last count of t's class
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cls(mid) == here else (lo, mid - 1)
        t = lo + 1
    return out


def _check(name, x, w13, w2, topk_ids, topk_weights) -> None:
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"{name}: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 "
                         f"{tuple(w2.shape)} must be [T, H], [E, 2I, H], [E, H, I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"{name}: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{t}, K]")
