"""A gated-DeltaNet layer's two projections with the op beside each (Qwen3-Next, Qwen3.5):
torch references and entries.

- ``in_proj_conv``: the input projection, then the short causal conv (SiLU'd, from each
  sequence's conv state in the per-slot pool, written back in place) over its first C columns
  (q, k, v); the other columns (z, b, a) as projected. The definition is the two entries in
  order, ``linear`` then ``causal_conv_step`` (``in_proj_conv_ref``: their references).
- ``gated_norm_out_proj``: the gated output norm per value head (``gated_rms_norm``), then
  the output projection: ``linear(gated_rms_norm(o, z, w, eps).reshape(n, Hv Dv), w_out)``
  (``gated_norm_out_proj_ref``: the references).

At one row on the Triton path (a batch-1 decode step, as a CUDA graph captures it) the first is
one launch of ``epserve.kernels.triton.deltanet_proj``: the GEMV with the conv in its epilogue
(a program's output rows are its conv channels: no other program touches their state);
otherwise the conv is a launch of its own. The second is always its two entries, a launch
each: the gated norm fused into the GEMV's prologue (every program re-normalising o for the
heads it streams) measured slower than the two launches once kernels launch with programmatic
dependent launch (H200, graph-timed at batch 1: 6.98 against 6.41 us, session 19;
bench/RESULTS.md), so it was removed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from epserve.kernels.causal_conv import causal_conv1d_ref, causal_conv_step
from epserve.kernels.dispatch import (DTYPES, MAX_CONV_WIDTH, gather_states, scatter_states,
                                      use_triton)
from epserve.kernels.linear import linear, linear_ref
from epserve.kernels.norm import gated_rms_norm, gated_rms_norm_ref


def in_proj_conv_ref(x: torch.Tensor, w_in: torch.Tensor, conv_weight: torch.Tensor,
                     state_pool: torch.Tensor, slots: torch.Tensor,
                     fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per sequence: ``proj = linear_ref(x, w_in)``, then ``causal_conv1d_ref``
    of ``proj[:, :C]`` from the sequences' states (the pool updated at ``slots``). Returns
    ``(conv output [S, C], proj[:, C:])``."""
    proj = linear_ref(x, w_in)
    c = conv_weight.shape[0]
    y, new = causal_conv1d_ref(proj[:, :c], conv_weight, gather_states(state_pool, slots, fresh),
                               list(range(x.shape[0] + 1)))
    scatter_states(state_pool, slots, new)
    return y, proj[:, c:]


def in_proj_conv(x: torch.Tensor, w_in: torch.Tensor, conv_weight: torch.Tensor,
                 state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                 cu_seqlens: Sequence[int], decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(x, w_in)``'s first C columns through ``causal_conv_step`` (same arguments:
    x [T, H]; w_in [N, H] with N >= C; conv_weight [C, K]; the conv pool [N_slots, C, K - 1]),
    and the other columns: ``(y [T, C], rest [T, N - C])`` in x's dtype (views of one buffer
    on the fused path)."""
    c = conv_weight.shape[0]
    if x.dim() != 2 or w_in.dim() != 2 or w_in.shape[1] != x.shape[1] or w_in.shape[0] < c:
        raise ValueError(f"in_proj_conv: x {tuple(x.shape)} must be [T, H] and w_in "
                         f"{tuple(w_in.shape)} [N >= {c}, H]")
    if decode and x.shape[0] == 1 and _in_covers(x, w_in, conv_weight, state_pool, slots):
        from epserve.kernels.triton.deltanet_proj import in_proj_conv_triton

        out = in_proj_conv_triton(x, w_in, conv_weight, state_pool, slots, fresh)
        return out[:, :c], out[:, c:]
    proj = linear(x, w_in)
    y = causal_conv_step(proj[:, :c], conv_weight, state_pool, slots, fresh, cu_seqlens, decode)
    return y, proj[:, c:]


def _in_covers(x, w_in, conv_weight, pool, slots) -> bool:
    """One dtype for x and w_in, the conv kernel's dtypes, widths and layouts."""
    if x.dtype not in DTYPES or w_in.dtype != x.dtype or conv_weight.dtype not in DTYPES \
            or pool.dtype not in DTYPES or slots.shape != (1,):
        return False
    if x.stride(-1) != 1 or w_in.stride(-1) != 1 or conv_weight.stride(-1) != 1 \
            or not 2 <= conv_weight.shape[1] <= MAX_CONV_WIDTH \
            or pool.shape[1:] != (conv_weight.shape[0], conv_weight.shape[1] - 1):
        return False
    return use_triton(x) and all(t.device == x.device for t in (w_in, conv_weight, pool))


def gated_norm_out_proj_ref(o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, w_out: torch.Tensor) -> torch.Tensor:
    """``linear_ref(gated_rms_norm_ref(o, z, norm_weight, eps).reshape(n, Hv Dv), w_out)``."""
    return linear_ref(gated_rms_norm_ref(o, z, norm_weight, eps).reshape(o.shape[0], -1), w_out)


def gated_norm_out_proj(o: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, w_out: torch.Tensor) -> torch.Tensor:
    """Public entry for ``gated_norm_out_proj_ref``: o, z [n, Hv, Dv] (z read in place: any
    strides but a contiguous last dim); norm_weight [Dv]; w_out [H, Hv Dv]. Returns [n, H] in
    o's dtype."""
    if o.dim() != 3 or z.shape != o.shape or norm_weight.shape != (o.shape[2],) \
            or w_out.dim() != 2 or w_out.shape[1] != o.shape[1] * o.shape[2]:
        raise ValueError(f"gated_norm_out_proj: o {tuple(o.shape)}, z {tuple(z.shape)} must "
                         f"be [n, Hv, Dv], norm_weight {tuple(norm_weight.shape)} [Dv] and "
                         f"w_out {tuple(w_out.shape)} [H, Hv Dv]")
    n = o.shape[0]
    return linear(gated_rms_norm(o, z, norm_weight, eps).reshape(n, -1), w_out)
