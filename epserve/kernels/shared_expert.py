"""The gated shared expert of the hybrids' MoE blocks (Qwen3-Next, Qwen3.5-MoE), added to the
routed experts' output: torch reference and entry.

    out = routed + sigmoid(x @ w_gate^T) * ((silu(g) * u) @ w_down^T),   [g, u] = x @ w_gate_up^T

x, routed: [T, H]; w_gate_up: [2I, H] (the I gate rows, then the I up rows); w_down: [H, I];
w_gate: [1, H] (the shared expert's gate). The projections are ``linear`` (float32
accumulation, rounded to x's dtype); every elementwise product is rounded to x's dtype, as
torch's eager ops are (``shared_expert_ref`` is those ops, the definition). ``routed`` may also
be the routed experts' pair rows before their combine (``moe.RoutedPairs``, from
``fused_moe_pairs``): it stands for ``combine_pairs`` of them.

``shared_expert_add`` is the entry. Where ``dispatch.use_triton`` says so it runs
``epserve.kernels.triton.shared_expert``: a one-row step (a batch-1 decode, the CUDA graph's
hottest case) in two launches (the gate_up and gate projections as one GEMV; the SwiGLU, the
down projection, the sigmoid gate and the add of the routed output as another) instead of
eight (three GEMVs and five elementwise ops), and given the routed pair rows the second launch
sums them too, so the MoE's combine launch goes (``shared_expert_pairs_triton``); more rows in
five (the three projections, the SwiGLU as one elementwise launch, the gate and the add as
another), after the combine's launch where pairs were given. Elsewhere the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels.dispatch import DTYPES, use_triton
from epserve.kernels.linear import linear
from epserve.kernels.moe import RoutedPairs, combine_pairs, combine_pairs_ref


def shared_expert_ref(x: torch.Tensor, routed: torch.Tensor | RoutedPairs,
                      w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      w_gate: torch.Tensor) -> torch.Tensor:
    """``routed + sigmoid(linear(x, w_gate)) * linear(silu(g) * u, w_down)`` with ``[g, u] =
    linear(x, w_gate_up)``: [T, H] in x's dtype (see the module); ``routed`` pairs are
    ``combine_pairs_ref`` of them."""
    if isinstance(routed, RoutedPairs):
        routed = combine_pairs_ref(routed)
    i = w_down.shape[1]
    gate_up = linear(x, w_gate_up)  # [T, 2I]
    shared = linear(F.silu(gate_up[:, :i]) * gate_up[:, i:], w_down)  # [T, H]
    return routed + torch.sigmoid(linear(x, w_gate)) * shared


def shared_expert_add(x: torch.Tensor, routed: torch.Tensor | RoutedPairs,
                      w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      w_gate: torch.Tensor) -> torch.Tensor:
    """Public entry for ``shared_expert_ref`` (same contract; the fused launches for one row
    on the Triton path, the routed pairs' combine among them)."""
    _check(x, routed, w_gate_up, w_down, w_gate)
    if isinstance(routed, RoutedPairs):
        if x.shape[0] == 1 and _fused_covers(x, routed.y, w_gate_up, w_down, w_gate):
            from epserve.kernels.triton.shared_expert import shared_expert_pairs_triton

            return shared_expert_pairs_triton(x, routed.y, routed.ids, w_gate_up, w_down, w_gate,
                                              routed.expert_offset, routed.num_local)
        routed = combine_pairs(routed)
    if not _fused_covers(x, routed, w_gate_up, w_down, w_gate):
        return shared_expert_ref(x, routed, w_gate_up, w_down, w_gate)
    if x.shape[0] == 1:
        from epserve.kernels.triton.shared_expert import shared_expert_triton

        return shared_expert_triton(x, routed, w_gate_up, w_down, w_gate)
    from epserve.kernels.triton.shared_expert import gate_add_triton, swiglu_triton

    shared = linear(swiglu_triton(linear(x, w_gate_up)), w_down)  # [T, H]
    return gate_add_triton(shared, linear(x, w_gate), routed)


def _check(x, routed, w_gate_up, w_down, w_gate) -> None:
    if isinstance(routed, RoutedPairs):
        if x.dim() != 2 or routed.ids.shape[0] != x.shape[0] or routed.y.shape[1] != x.shape[1]:
            raise ValueError(f"shared_expert_add: x {tuple(x.shape)} must be [T, H] for routed "
                             f"pairs y {tuple(routed.y.shape)} [T * K, H], ids "
                             f"{tuple(routed.ids.shape)} [T, K]")
    elif x.dim() != 2 or routed.shape != x.shape:
        raise ValueError(f"shared_expert_add: x {tuple(x.shape)} and routed "
                         f"{tuple(routed.shape)} must both be [T, H]")
    h = x.shape[1]
    i = w_down.shape[1] if w_down.dim() == 2 else -1
    if w_gate_up.shape != (2 * i, h) or w_down.shape != (h, i) or w_gate.shape != (1, h):
        raise ValueError(f"shared_expert_add: w_gate_up {tuple(w_gate_up.shape)}, w_down "
                         f"{tuple(w_down.shape)}, w_gate {tuple(w_gate.shape)} must be "
                         f"[2I, {h}], [{h}, I], [1, {h}]")


def _fused_covers(x, routed, w_gate_up, w_down, w_gate) -> bool:
    """The Triton path, one dtype of ``DTYPES`` throughout, last dims contiguous (``routed``: a
    [T, H] row block or the pairs' y)."""
    tensors = (x, routed, w_gate_up, w_down, w_gate)
    if x.shape[0] == 0 or x.dtype not in DTYPES or any(t.dtype != x.dtype for t in tensors):
        return False
    if any(t.stride(-1) != 1 for t in tensors) or w_down.shape[1] == 0:
        return False
    return use_triton(x) and all(t.device == x.device for t in tensors)
