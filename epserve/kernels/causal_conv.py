"""The short causal convolution of gated-DeltaNet layers, over a step's packed sequences, each
continuing from its own convolution state: torch reference.

Channel c of token t is ``sum_j w[c, j] * x[t - (K - 1) + j, c]`` (a depthwise convolution of
width K over the sequence's inputs, padded with zeros before its first token), then the
activation (SiLU). ``state`` [S, C, K - 1] holds each sequence's last K - 1 inputs before
these tokens (zeros for a new sequence); the new state is the last K - 1 inputs after them.
Invariant: splitting a sequence's tokens over calls that carry the state gives the outputs of
one call.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                      cu_seqlens: Sequence[int], silu: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, C] packed tokens (``cu_seqlens``: S + 1 host offsets), ``weight`` [C, K],
    ``state`` [S, C, K - 1]; returns the outputs [T, C] (``x``'s dtype) and the new states."""
    t, c = x.shape
    kw = weight.shape[1]
    if weight.shape[0] != c or state.shape[1:] != (c, kw - 1) or \
            len(cu_seqlens) != state.shape[0] + 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != t:
        raise ValueError(f"causal conv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"state {tuple(state.shape)}, cu_seqlens {list(cu_seqlens)}")
    out = torch.empty_like(x)
    new = state.clone()
    w = weight.float()
    for s in range(len(cu_seqlens) - 1):
        a, b = cu_seqlens[s], cu_seqlens[s + 1]
        xs = torch.cat([state[s].float(), x[a:b].float().T], dim=1)  # [C, K - 1 + n]
        y = F.conv1d(xs[None], w[:, None, :], groups=c)[0]  # [C, n]
        out[a:b] = (F.silu(y) if silu else y).T.to(x.dtype)
        new[s] = xs[:, xs.shape[1] - (kw - 1):].to(state.dtype)
    return out, new
