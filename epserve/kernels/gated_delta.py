"""The gated delta rule (the linear attention of gated-DeltaNet layers: Qwen3-Next, Qwen3.5):
torch references over a step's packed sequences, each from its own recurrent state.

Per value head, a state ``S`` [Dk, Dv] evolves token by token::

    S <- exp(g_t) * S                      (the gate, g_t <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T   (the delta rule: write what k_t misses)
    o_t = S^T q_t

with ``q`` and ``k`` L2-normalised (``qk_l2norm``) and ``q`` scaled by ``Dk ** -0.5``; key and
query heads are shared by ``Hv / Hk`` consecutive value heads. ``recurrent_ref`` runs that
loop (one decode token, or the definition the other forms are tested against);
``chunked_ref`` computes the same in chunks of ``chunk`` tokens (within a chunk the updates
are solved at once: a unit lower-triangular system in the chunk's keys), which is how a
prompt is prefilled. Both take packed tokens ``[T, H, D]`` of several sequences
(``cu_seqlens``: host offsets, S + 1 entries) and ``state`` [S, Hv, Dk, Dv] (the sequences'
states before these tokens, float32), and return the outputs [T, Hv, Dv] in the input's dtype
and the states after them. Invariant: splitting a sequence's tokens over several calls, each
starting from the state the last one returned, gives the outputs of one call (chunked
prefill, then decode).

``gated_delta_step`` is the entry over a per-slot state pool ``[N, Hv, Dk, Dv]`` (a layer's
recurrent cache, float32): sequence s continues from ``state_pool[slots[s]]`` (zeros where
``fresh[s]``) and its new state is written back there, in place; no other slot is touched
(CUDA-graph padding rows all name one spare slot, which they may overwrite). Where it runs:

- a decode step (one token per sequence) where ``dispatch.use_triton`` says so:
  ``epserve.kernels.triton.gated_delta_decode``, one launch reading and writing the pool
  through ``slots`` (CUDA-graph capturable: nothing read from the host);
- a step of a few tokens a sequence (``dispatch.short_step``: a speculative verify's k + 1, a
  fold's accepted prefix) where the decode kernel would run: its varlen form, one launch, each
  program walking its sequence's rows (held sequences' slots not written);
- any other step on CUDA with fla-core installed: fla's ``chunk_gated_delta_rule`` (varlen,
  q/k normalised in its kernel; same state layout), the states gathered and scattered;
- otherwise (CPU, or no fla) ``recurrent_ref`` for a decode step, else ``chunked_ref``,
  gathered and scattered.

``gated_delta_step_gates`` is the same entry given the layer's ``a``, ``b`` projections and its
``A_log``, ``dt_bias`` (``delta_gates_ref`` defines g and beta from them): a decode step on the
Triton path computes them inside the decode kernel (no torch launch); anywhere else
``delta_gates_ref`` runs, then ``gated_delta_step``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from epserve.kernels.dispatch import (DTYPES, MAX_DELTA_DK, check_hold, check_state_step,
                                      fla_function, fla_offsets, gather_states, scatter_states,
                                      short_step, use_triton, varlen_tensors)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_l2norm: bool,
             eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 q, k with the value heads' layout (grouped heads repeated), normalised and q
    scaled."""
    rep = v.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float(), v.float()
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    if qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    return q * q.shape[-1] ** -0.5, k, v


def _setup(q, k, v, g, beta, state, cu_seqlens: Sequence[int], qk_l2norm: bool) -> tuple:
    """Checked, float32 inputs in the value heads' layout, an output buffer and a copy of the
    states: (q, k, v, g, beta, out, states)."""
    _check(q, k, v, g, beta, state, cu_seqlens)
    q, k, v = _prepare(q, k, v, qk_l2norm)
    return q, k, v, g.float(), beta.float(), torch.empty_like(v), state.float().clone()


def _check(q, k, v, g, beta, state, cu_seqlens: Sequence[int]) -> None:
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if q.shape != k.shape or v.shape[0] != t or g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"gated delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if hv % hk:
        raise ValueError(f"gated delta rule: {hv} value heads over {hk} key heads")
    if len(cu_seqlens) != state.shape[0] + 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != t \
            or state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"gated delta rule: cu_seqlens {list(cu_seqlens)} and state "
                         f"{tuple(state.shape)} for {t} tokens, heads {hv} x ({dk}, {dv})")


def recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor, cu_seqlens: Sequence[int],
                  qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token (see the module)."""
    dtype = v.dtype
    q, k, v, g, beta, out, new = _setup(q, k, v, g, beta, state, cu_seqlens, qk_l2norm)
    for s in range(len(cu_seqlens) - 1):
        st = new[s]  # [Hv, Dk, Dv]
        for t in range(cu_seqlens[s], cu_seqlens[s + 1]):
            st = st * g[t].exp()[:, None, None]
            miss = v[t] - torch.einsum("hkv,hk->hv", st, k[t])
            st = st + k[t][:, :, None] * (beta[t][:, None] * miss)[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", st, q[t])
        new[s] = st
    return out.to(dtype), new


def chunked_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor, cu_seqlens: Sequence[int],
                qk_l2norm: bool = True, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule, ``chunk`` tokens at a time per sequence.

    In a chunk with gate sums ``G_i = g_1 + .. + g_i`` and entry state ``S``, token i's write
    is ``u_i = beta_i (v_i - exp(G_i) S^T k_i - sum_{j<i} exp(G_i - G_j) (k_j . k_i) u_j)``: a
    unit lower-triangular system ``(I + L) U = beta (V - exp(G) K S)`` with
    ``L_ij = beta_i exp(G_i - G_j) k_i . k_j`` (j < i), solved by forward substitution. Then
    ``o_i = exp(G_i) q_i S + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j`` and the exit state is
    ``exp(G_c) S + sum_j exp(G_c - G_j) k_j u_j^T``."""
    dtype = v.dtype
    q, k, v, g, beta, out, new = _setup(q, k, v, g, beta, state, cu_seqlens, qk_l2norm)
    for s in range(len(cu_seqlens) - 1):
        st = new[s].clone()  # [H, Dk, Dv]
        for a in range(cu_seqlens[s], cu_seqlens[s + 1], chunk):
            b = min(a + chunk, cu_seqlens[s + 1])
            qc, kc, vc = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, n, D]
            gsum = g[a:b].transpose(0, 1).cumsum(-1)  # [H, n]
            bc = beta[a:b].transpose(0, 1)  # [H, n]
            decay = (gsum[:, :, None] - gsum[:, None, :])  # [H, n, n]: G_i - G_j
            n = b - a
            lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
            incl = lower | torch.eye(n, dtype=torch.bool, device=q.device)
            w = torch.where(lower, decay, float("-inf")).exp()  # exp(G_i - G_j), j < i
            ell = bc[:, :, None] * w * (kc @ kc.transpose(1, 2))  # [H, n, n]
            rhs = bc[:, :, None] * (vc - gsum.exp()[:, :, None] * (kc @ st))  # [H, n, Dv]
            u = torch.linalg.solve_triangular(
                torch.eye(n, device=q.device) + ell, rhs, upper=False, unitriangular=True)
            wi = torch.where(incl, decay, float("-inf")).exp()  # j <= i
            out[a:b] = (gsum.exp()[:, :, None] * (qc @ st)
                        + (wi * (qc @ kc.transpose(1, 2))) @ u).transpose(0, 1)
            tail = (gsum[:, -1:] - gsum).exp()  # [H, n]: exp(G_c - G_j)
            st = gsum[:, -1].exp()[:, None, None] * st + (kc * tail[:, :, None]).transpose(1, 2) @ u
        new[s] = st
    return out.to(dtype), new


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor,
                     fresh: torch.Tensor, cu_seqlens: Sequence[int], decode: bool,
                     hold: Sequence[int] = ()) -> torch.Tensor:
    """The rule (q and k L2-normalised, q scaled by ``Dk ** -0.5``) over the per-slot pool, in
    place (see the module).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decays), beta: [T, Hv]; ``cu_seqlens``: S + 1
    host offsets; state_pool: [N, Hv, Dk, Dv]; slots: [S] int64; fresh: [S] bool;
    ``decode``: every sequence has one token (``cu_seqlens`` is ``0, 1, .., S``: trusted, not
    read, so a CUDA graph may hold placeholders); ``hold``: host indices of sequences whose new
    state is not written back (a speculative verify's: ``dispatch.scatter_states``; never on
    a decode step). Returns o [T, Hv, Dv] in v's dtype."""
    _check_step("gated_delta_step", q, k, v, state_pool, slots, fresh, cu_seqlens, decode,
                hold)
    if decode and _decode_kernel_covers(q, k, v, g, beta, state_pool):
        from epserve.kernels.triton.gated_delta_decode import gated_delta_decode_triton

        return gated_delta_decode_triton(q, k, v, g, beta, state_pool, slots, fresh)
    if short_step(cu_seqlens, q.shape[0]) and \
            _decode_kernel_covers(q, k, v, g, beta, state_pool):
        from epserve.kernels.triton.gated_delta_decode import gated_delta_varlen_triton

        return gated_delta_varlen_triton(q, k, v, g, beta, state_pool, slots, fresh,
                                         *varlen_tensors(cu_seqlens, hold, v.device))
    chunk = fla_function(v, "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    if chunk is not None and _fla_covers(q, k, v, state_pool):
        return _rule_fla(chunk, q, k, v, g, beta, state_pool, slots, fresh, cu_seqlens, hold)
    rule = recurrent_ref if decode else chunked_ref
    o, new = rule(q, k, v, g, beta, gather_states(state_pool, slots, fresh), cu_seqlens)
    scatter_states(state_pool, slots, new, hold)
    return o


def _check_step(name: str, q, k, v, state_pool, slots, fresh, cu_seqlens: Sequence[int],
                decode: bool, hold: Sequence[int] = ()) -> None:
    """q, k [T, Hk, Dk], v [T, Hv, Dv] over the pool's states (one row a sequence when
    ``decode``), the holds and ``cu_seqlens`` (S + 1 entries)."""
    if q.dim() != 3 or q.shape != k.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)} must be [T, Hk, Dk] "
                         f"and v {tuple(v.shape)} [T, Hv, Dv]")
    hv, dv = v.shape[1:]
    s = check_state_step(name, state_pool, (hv, q.shape[2], dv), slots, fresh,
                         rows=q.shape[0] if decode else None)
    check_hold(name, hold, s, decode)
    if len(cu_seqlens) != s + 1:
        raise ValueError(f"{name}: cu_seqlens has {len(cu_seqlens)} entries for {s} sequences")


def delta_gates_ref(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                    dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DeltaNet layer's log decay and write strength from its projections a, b [T, Hv] and
    its A_log, dt_bias [Hv]: ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32, <= 0) and
    ``beta = sigmoid(b)`` (b's dtype), as transformers computes them."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def gated_delta_step_gates(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                           b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                           state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                           cu_seqlens: Sequence[int], decode: bool,
                           hold: Sequence[int] = (),
                           varlen: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> torch.Tensor:
    """``gated_delta_step(q, k, v, *delta_gates_ref(a, b, A_log, dt_bias), state_pool, slots,
    fresh, cu_seqlens, decode, hold)``: a, b [T, Hv] (any strides), A_log, dt_bias [Hv]. On a
    decode step or a short one (``dispatch.short_step``) the Triton kernel computes g and beta
    itself; ``varlen`` as for ``causal_conv.causal_conv_step`` (the step's device offsets and
    hold mask, read by that kernel instead of a copy of ``cu_seqlens`` and ``hold``)."""
    name = "gated_delta_step_gates"
    _check_step(name, q, k, v, state_pool, slots, fresh, cu_seqlens, decode, hold)
    t, hv = q.shape[0], v.shape[1]
    if a.shape != (t, hv) or b.shape != (t, hv) or A_log.shape != (hv,) \
            or dt_bias.shape != (hv,):
        raise ValueError(f"{name}: a {tuple(a.shape)}, b {tuple(b.shape)} must be [{t}, {hv}] "
                         f"and A_log {tuple(A_log.shape)}, dt_bias {tuple(dt_bias.shape)} [{hv}]")
    kernel = _decode_kernel_covers(q, k, v, a, b, state_pool) and all(
        x.dtype in DTYPES and x.device == v.device for x in (A_log, dt_bias))
    if decode and kernel:
        from epserve.kernels.triton.gated_delta_decode import gated_delta_decode_gates_triton

        return gated_delta_decode_gates_triton(q, k, v, a, b, A_log, dt_bias, state_pool, slots,
                                               fresh)
    if kernel and short_step(cu_seqlens, t):
        from epserve.kernels.triton.gated_delta_decode import gated_delta_varlen_triton

        return gated_delta_varlen_triton(q, k, v, a, b, state_pool, slots, fresh,
                                         *(varlen or varlen_tensors(cu_seqlens, hold, v.device)),
                                         gates=(A_log.contiguous(), dt_bias.contiguous()))
    g, beta = delta_gates_ref(a, b, A_log, dt_bias)
    return gated_delta_step(q, k, v, g, beta, state_pool, slots, fresh, cu_seqlens, decode, hold)


def _decode_kernel_covers(q, k, v, g, beta, pool) -> bool:
    """``use_triton`` and the dtypes, head dims and layouts the decode kernel takes."""
    tensors = (q, k, v, g, beta, pool)
    if any(t.dtype not in DTYPES for t in tensors) or q.shape[2] > MAX_DELTA_DK:
        return False
    if any(t.stride(-1) != 1 for t in (q, k, v, pool)) or v.shape[1] % max(1, k.shape[1]):
        return False
    return use_triton(v) and all(t.device == v.device for t in tensors)


def _fla_covers(q, k, v, pool) -> bool:
    """fla's chunked kernels: one dtype for q, k, v; head dims multiples of 16, Dk <= 256."""
    dk, dv = q.shape[2], v.shape[2]
    return (q.dtype == k.dtype == v.dtype and v.dtype in DTYPES and pool.dtype in DTYPES
            and 16 <= dk <= 256 and dk % 16 == 0 and dv % 16 == 0 and dv > 0
            and k.shape[1] > 0 and v.shape[1] % k.shape[1] == 0)


def _rule_fla(chunk, q, k, v, g, beta, pool, slots, fresh, cu_seqlens, hold) -> torch.Tensor:
    """fla's varlen chunked rule from the gathered states (float32 [S, Hv, Dk, Dv], its layout);
    its final states (float32) go back to the slots."""
    cu, cu_cpu = fla_offsets(cu_seqlens, v.device)
    h0 = gather_states(pool, slots, fresh).float()
    o, final = chunk(q[None], k[None], v[None], g.float()[None], beta[None],
                     scale=q.shape[2] ** -0.5, initial_state=h0, output_final_state=True,
                     cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True)
    scatter_states(pool, slots, final, hold)
    return o[0].to(v.dtype)
