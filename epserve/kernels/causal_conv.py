"""The short causal convolution of gated-DeltaNet layers, over a step's packed sequences, each
continuing from its own convolution state: torch reference.

Channel c of token t is ``sum_j w[c, j] * x[t - (K - 1) + j, c]`` (a depthwise convolution of
width K over the sequence's inputs, padded with zeros before its first token), then the
activation (SiLU). ``state`` [S, C, K - 1] holds each sequence's last K - 1 inputs before
these tokens (zeros for a new sequence); the new state is the last K - 1 inputs after them.
Invariant: splitting a sequence's tokens over calls that carry the state gives the outputs of
one call.

``causal_conv_step`` is the entry over a per-slot state pool ``[N, C, K - 1]`` (a layer's conv
cache): sequence s continues from ``state_pool[slots[s]]`` (zeros where ``fresh[s]``) and its
new state is written back there, in place; no other slot is touched (CUDA-graph padding rows
all name one spare slot, which they may overwrite). Where it runs:

- a decode step (one token per sequence) where ``dispatch.use_triton`` says so:
  ``epserve.kernels.triton.causal_conv_update``, one launch reading and writing the pool
  through ``slots`` (CUDA-graph capturable: nothing read from the host);
- a short step (``dispatch.short_step``: at most ``MAX_SHORT_TOKENS`` tokens a sequence, a
  speculative verify's k + 1 or a fold's accepted prefix) where ``use_triton`` says so: the same
  module's varlen kernel, one launch, its offsets and hold mask on the device from one copy the
  step's layers share (``dispatch.varlen_tensors``; fla's chunked conv syncs with the host);
- any other step on CUDA with fla-core installed: fla's ``causal_conv1d`` (its states are
  ``[N, C, K]`` with the last K - 1 columns ours: converted at the boundary), the states
  gathered and scattered;
- otherwise (CPU, or no fla) the reference, gathered and scattered.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from epserve.kernels.dispatch import (DTYPES, MAX_CONV_WIDTH, check_hold, check_state_step,
                                      fla_function, fla_offsets, gather_states, scatter_states,
                                      short_step, use_triton, varlen_tensors)


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
        if a == b:  # an empty sequence (a CUDA graph's padding run): its state as it was
            continue
        xs = torch.cat([state[s].float(), x[a:b].float().T], dim=1)  # [C, K - 1 + n]
        y = F.conv1d(xs[None], w[:, None, :], groups=c)[0]  # [C, n]
        out[a:b] = (F.silu(y) if silu else y).T.to(x.dtype)
        new[s] = xs[:, xs.shape[1] - (kw - 1):].to(state.dtype)
    return out, new


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, state_pool: torch.Tensor,
                     slots: torch.Tensor, fresh: torch.Tensor, cu_seqlens: Sequence[int],
                     decode: bool, hold: Sequence[int] = (),
                     varlen: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``causal_conv1d_ref`` (SiLU applied) over the per-slot pool, in place (see the module).

    x: [T, C] packed tokens (``cu_seqlens``: S + 1 host offsets); weight: [C, K]; state_pool:
    [N, C, K - 1]; slots: [S] int64 (each sequence's slot); fresh: [S] bool (the sequence starts
    from zeros); ``decode``: every sequence has one token (``cu_seqlens`` is ``0, 1, .., S``:
    trusted, not read, so a CUDA graph may hold placeholders); ``hold``: host indices of
    sequences whose new state is not written back (``dispatch.scatter_states``; never on a
    decode step); ``varlen``: the step's offsets [S + 1] int32 and hold mask [S] bool already on
    the device (``kernels.attention.StateRuns``; the truth a CUDA graph replays), which the
    varlen kernel then reads instead of a copy of ``cu_seqlens`` and ``hold``. Returns y [T, C]
    in x's dtype."""
    name = "causal_conv_step"
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 1:
        raise ValueError(f"{name}: x {tuple(x.shape)} must be [T, C] and weight "
                         f"{tuple(weight.shape)} [C, K]")
    kw = weight.shape[1]
    s = check_state_step(name, state_pool, (x.shape[1], kw - 1), slots, fresh,
                         rows=x.shape[0] if decode else None)
    check_hold(name, hold, s, decode)
    if len(cu_seqlens) != s + 1:
        raise ValueError(f"{name}: cu_seqlens has {len(cu_seqlens)} entries for {s} sequences")
    if decode and _update_kernel_covers(x, weight, state_pool):
        from epserve.kernels.triton.causal_conv_update import causal_conv_update_triton

        return causal_conv_update_triton(x, weight, state_pool, slots, fresh)
    if not decode and short_step(cu_seqlens, x.shape[0]) and \
            _update_kernel_covers(x, weight, state_pool):
        from epserve.kernels.triton.causal_conv_update import causal_conv_varlen_triton

        return causal_conv_varlen_triton(x, weight, state_pool, slots, fresh,
                                         *(varlen or varlen_tensors(cu_seqlens, hold, x.device)))
    fla_conv = fla_function(x, "fla.modules.causal_conv1d", "causal_conv1d")
    if fla_conv is not None and x.dtype in DTYPES and kw >= 2:
        return _conv_fla(fla_conv, x, weight, state_pool, slots, fresh, cu_seqlens, hold)
    y, new = causal_conv1d_ref(x, weight, gather_states(state_pool, slots, fresh), cu_seqlens)
    scatter_states(state_pool, slots, new, hold)
    return y


def _update_kernel_covers(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor) -> bool:
    """``use_triton`` and the dtypes, widths and layouts the Triton kernels take."""
    if any(t.dtype not in DTYPES for t in (x, weight, pool)) or x.stride(-1) != 1 or \
            weight.stride(-1) != 1 or not 2 <= weight.shape[1] <= MAX_CONV_WIDTH:
        return False
    return use_triton(x) and weight.device == x.device == pool.device


def _conv_fla(fla_conv, x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor,
              slots: torch.Tensor, fresh: torch.Tensor, cu_seqlens: Sequence[int],
              hold: Sequence[int]) -> torch.Tensor:
    """fla's varlen causal conv. Its states are [S, C, K]: position p < 0 of a sequence is
    column ``K + p``, so column 0 (the K-th input back) is never read and ours, the last K - 1
    inputs, are columns 1..K-1 of both the initial and the final state."""
    init = F.pad(gather_states(pool, slots, fresh), (1, 0))  # [S, C, K], the pool's dtype
    cu, cu_cpu = fla_offsets(cu_seqlens, x.device)
    y, final = fla_conv(x=x[None], weight=weight, bias=None, initial_state=init,
                        output_final_state=True, activation="silu", cu_seqlens=cu,
                        cu_seqlens_cpu=cu_cpu)
    scatter_states(pool, slots, final[..., 1:], hold)
    return y[0]
