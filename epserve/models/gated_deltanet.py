"""The gated-DeltaNet layer (linear attention) of Qwen3-Next and Qwen3.5-MoE.

Shapes: T rows in the flat batch, H hidden, Hk key heads of Dk, Hv value heads of Dv
(Hv a multiple of Hk), C = 2 Hk Dk + Hv Dv conv channels, K conv width, N state slots.

Per token, as transformers defines it: one projection gives q, k, v (the conv channels), z
(the output gate, per value head), b and a (per value head); a short causal conv (width K,
from the sequence's conv state) and SiLU mix [q, k, v]; ``beta = sigmoid(b)``, the log decay
``g = -exp(A_log) * softplus(a + dt_bias)``; the gated delta rule (q, k L2-normalised in it)
from the sequence's recurrent state; the gated norm ``rms_norm(o) * w * silu(z)`` per value
head; ``out_proj``.

Invariants: each sequence of the step reads its conv and recurrent states from its slot
(``meta.state_slots``), or zeros when it starts fresh (no KV before the step), and its new
states are written back into the same slots, in place; no other slot is touched. The two
entries own that: ``causal_conv_step`` and ``gated_delta_step`` work on the pools at the
slots (a pure decode step: the Triton decode kernels on CUDA, CUDA-graph capturable; a
prefill: fla-core's kernels on CUDA where installed; the torch references otherwise, the
recurrent form for a pure decode step, the chunked one else). Rows past
``query_start_loc[-1]`` are padding: output zeros, no state read or written. A speculative
verify's step (``meta.state_runs``: attention sees one-token rows, the layer runs) reads its
runs' offsets, slots and flags from the device (a CUDA graph replays new ones); the held runs
start from their states but do not write them: the layer logs every row's conv inputs and
projections a, b (``StateRuns.log``), and once the verdict is known ``fold`` advances each
state by the accepted tokens only (so a rejected draft never touches a state). Every step
hands a and b to ``gated_delta_step_gates``, whose decode and varlen kernels compute g and
beta in their programs; a step without runs runs its projections
through ``deltanet_proj`` (``in_proj_conv``, ``gated_norm_out_proj``): a one-row decode step
on CUDA is then four launches (the input projection with the conv update, the decode kernel,
the gated norm, the output projection).
"""

from __future__ import annotations

import torch
from torch import nn

from epserve.kernels.attention import AttentionMetadata, StateRuns
from epserve.kernels.causal_conv import causal_conv_step
from epserve.kernels.deltanet_proj import gated_norm_out_proj, in_proj_conv
from epserve.kernels.gated_delta import gated_delta_step_gates
from epserve.kernels.linear import linear
from epserve.kernels.norm import gated_rms_norm
from epserve.models.config import ModelConfig
from epserve.models.layer_cache import StateCacheSpec
from epserve.models.layers import RMSNorm, WeightMap, part_major_rows

StatePair = tuple[torch.Tensor, torch.Tensor]  # (conv_state [N, C, K-1], recurrent [N, Hv, Dk, Dv])


class GatedRMSNorm(RMSNorm):
    """The DeltaNet output norm: plain ``weight * x / rms(x)`` per value head, times
    ``silu(gate)``."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """One fused input projection ``in_proj`` (rows: q [Hk Dk], k [Hk Dk], v [Hv Dv],
    z [Hv Dv], b [Hv], a [Hv]), the depthwise conv ``conv_weight`` [C, K], ``A_log`` and
    ``dt_bias`` [Hv], the gated norm over Dv, ``out_proj``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.in_proj = nn.Linear(h, self.conv_dim + self.value_dim + 2 * self.num_v_heads,
                                 bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, states: StatePair,
                meta: AttentionMetadata, rope: nn.Module | None = None) -> torch.Tensor:
        """x: [T, H]; states: (conv_state [N, C, K-1], recurrent_state [N, Hv, Dk, Dv] float32),
        updated in place at ``meta.state_slots``. ``positions`` and ``rope`` are unused (the
        token mixers share one call). Returns [T, H]. A step of no sequences (an idle EP rank
        still runs the layers for the MoE collectives) needs no ``state_slots``."""
        if meta.num_seqs == 0:
            return x.new_zeros(x.shape[0], self.out_proj.weight.shape[0])
        if meta.state_slots is None and meta.state_runs is None:
            raise ValueError("GatedDeltaNet: AttentionMetadata.state_slots is required "
                             "(each sequence's state slot)")
        qsl = meta.query_start_loc
        if qsl[0] != 0:
            raise ValueError(f"GatedDeltaNet: query_start_loc must start at 0, got {qsl[0]}")
        runs = meta.state_runs
        t, n = x.shape[0], (qsl[-1] if runs is None else runs.cu[-1])
        hv, dv = self.num_v_heads, self.head_v_dim
        conv_state, rec_state = states
        if runs is not None:  # a verify's rows: logged, the held runs' states not written
            proj = linear(x[:n], self.in_proj.weight)  # [n, C + Hv Dv + 2 Hv]
            mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, hv, hv], dim=-1)
            runs.log.append((mixed, a, b))
            slots, cu, fresh, hold = runs.tensors(x.device)
            mixed = causal_conv_step(mixed, self.conv_weight, conv_state, slots, fresh, runs.cu,
                                     False, runs.hold, (cu, hold))  # SiLU'd
            o = gated_delta_step_gates(*self._qkv(mixed), a, b, self.A_log, self.dt_bias,
                                       rec_state, slots, fresh, runs.cu, False, runs.hold,
                                       (cu, hold))  # [n, Hv, Dv]
        else:  # the conv in the projection's launch and g, beta in the decode kernel's (CUDA)
            slots = meta.state_slots
            fresh = fresh_sequences(meta, x.device)  # [S]
            decode = qsl == tuple(range(len(qsl)))
            mixed, rest = in_proj_conv(x[:n], self.in_proj.weight, self.conv_weight,
                                       conv_state, slots, fresh, qsl, decode)  # SiLU'd
            z, b, a = rest.split([self.value_dim, hv, hv], dim=-1)
            o = gated_delta_step_gates(*self._qkv(mixed), a, b, self.A_log, self.dt_bias,
                                       rec_state, slots, fresh, qsl, decode)
        # the gated norm (z read in place) and out_proj: one launch on CUDA at one row
        out = gated_norm_out_proj(o, z.view(n, hv, dv), self.norm.weight, self.norm.eps,
                                  self.out_proj.weight)  # [n, H]
        if n < t:  # padding rows
            out = torch.cat([out, out.new_zeros(t - n, out.shape[1])])
        return out

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolved channels [n, C] as q, k [n, Hk, Dk] and v [n, Hv, Dv]."""
        n, kd = mixed.shape[0], self.key_dim
        return (mixed[:, :kd].reshape(n, self.num_k_heads, self.head_k_dim),
                mixed[:, kd:2 * kd].reshape(n, self.num_k_heads, self.head_k_dim),
                mixed[:, 2 * kd:].reshape(n, self.num_v_heads, self.head_v_dim))

    def fold(self, logged: tuple[torch.Tensor, torch.Tensor, torch.Tensor], states: StatePair,
             runs: StateRuns, first: int) -> None:
        """Advance held sequences' states by an accepted prefix of their logged tokens (what
        ``forward`` appended to ``StateRuns.log``: every row's conv inputs and projections a,
        b), in place: the states become those of a plain decode of the kept tokens. ``runs``
        (``fold_runs``) covers the logged rows from ``first`` on: each kept prefix a run into
        its sequence's slot, every other row a held run (computed, never stored)."""
        x, a, b = logged
        n = first + runs.cu[-1]
        slots, cu, fresh, hold = runs.tensors(x.device)
        mixed = causal_conv_step(x[first:n], self.conv_weight, states[0], slots, fresh, runs.cu,
                                 False, runs.hold, (cu, hold))
        gated_delta_step_gates(*self._qkv(mixed), a[first:n], b[first:n], self.A_log,
                               self.dt_bias, states[1], slots, fresh, runs.cu, False, runs.hold,
                               (cu, hold))

    def cache_spec(self) -> StateCacheSpec:
        return StateCacheSpec(conv_shape=(self.conv_dim, self.conv_kernel - 1),
                              recurrent_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
                              conv_dtype=self.conv_weight.dtype)


_FRESH_CACHE: list = [None, None, None]  # [meta, key, mask]: one step's layers share it


def fresh_sequences(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """[S] bool on ``device``: sequence s starts from a zero state, i.e. it had no KV before
    this step (``seq_lens[s]`` equals its row count). A pure decode batch with ``seq_lens_t``
    reads the device lengths (length 1), so a CUDA graph replays with new lengths.

    One step's layers share one mask (one launch a step, not one a layer): a metadata object
    is one step's. For device lengths the key is also whether a CUDA graph is being captured
    (a capture computes the mask inside the graph, never reusing one from the eager warm-up
    runs of the same metadata, so every replay recomputes it from the replayed lengths) and,
    outside inference mode (whose tensors keep none), the lengths' version."""
    qsl = meta.query_start_loc
    c = _FRESH_CACHE
    lens = meta.seq_lens_t
    if lens is not None and qsl == tuple(range(len(qsl))):
        key = (device, lens.is_cuda and torch.cuda.is_current_stream_capturing(),
               -1 if lens.is_inference() else lens._version)
        if c[0] is meta and c[1] == key:
            return c[2]
        mask = lens == 1
        c[:] = [meta, key, mask]
        return mask
    if c[0] is meta and c[1] == device:
        return c[2]
    mask = torch.tensor([meta.seq_lens[s] == qsl[s + 1] - qsl[s] for s in range(meta.num_seqs)],
                        dtype=torch.bool, device=device)
    c[:] = [meta, device, mask]
    return mask


def fold_runs(runs: StateRuns, kept: list[int],
              singles: bool = False) -> tuple[StateRuns, int]:
    """The runs ``GatedDeltaNet.fold`` takes after a verify with ``runs`` whose held runs keep
    their first ``kept[i]`` rows (in hold order; each in 1..its length), and the first logged
    row they cover (the first held run's): a held run's kept prefix advances its slot; its
    other rows, and any row between held runs, run as held runs on a fresh state (never read,
    never stored), so the rows stay one contiguous block without a gather. ``singles``: from
    row 0 on, every row outside a kept prefix a held run of its own (a CUDA graph's fold: no
    program walks more rows than a kept prefix)."""
    cu, held = runs.cu, runs.hold
    if len(kept) != len(held):
        raise ValueError(f"fold: {len(kept)} verdicts for {len(held)} held sequences")
    lens = [cu[h + 1] - cu[h] for h in held]
    if not all(1 <= m <= n for m, n in zip(kept, lens)):
        raise ValueError(f"fold: kept {kept} outside 1..{lens}")
    if not held:
        raise ValueError("fold: no held sequences")
    first = 0 if singles else cu[min(held)]
    at = first
    offs, slots, fresh, hold = [0], [], [], []

    def run(end: int, slot: int, new: bool, store: bool) -> None:
        offs.append(end - first)
        slots.append(slot)
        fresh.append(new)
        if not store:
            hold.append(len(slots) - 1)

    def rest(start: int, end: int, slot: int) -> None:  # rows folded into no state
        for r in (range(start + 1, end + 1) if singles else (end,) if end > start else ()):
            run(r, slot, True, False)

    for h, m in sorted(zip(held, kept)):
        rest(at, cu[h], int(runs.slots[h]))  # rows between held runs
        run(cu[h] + m, int(runs.slots[h]), bool(runs.fresh[h]), True)
        rest(cu[h] + m, cu[h + 1], int(runs.slots[h]))
        at = cu[h + 1]
    if singles:
        rest(at, cu[-1], int(runs.slots[0]))
    return StateRuns(tuple(offs), slots, fresh, tuple(hold)), first


# --------------------------------------------------------------------------- weight names


def map_deltanet_grouped(wm: WeightMap, prefix: str, layer: GatedDeltaNet) -> None:
    """Qwen3-Next's names: ``in_proj_qkvz`` grouped per key head (q [Dk], k [Dk], v [r Dv],
    z [r Dv] with r = Hv / Hk) and ``in_proj_ba`` likewise (b [r], a [r])."""
    hk, r = layer.num_k_heads, layer.num_v_heads // layer.num_k_heads
    dk, dv = layer.head_k_dim, layer.head_v_dim
    qkvz = layer.conv_dim + layer.value_dim
    wm.add(f"{prefix}.in_proj_qkvz.weight", layer.in_proj.weight, (slice(0, qkvz),),
           src_index=(part_major_rows(hk, [dk, dk, r * dv, r * dv]),))
    wm.add(f"{prefix}.in_proj_ba.weight", layer.in_proj.weight,
           (slice(qkvz, qkvz + 2 * layer.num_v_heads),), src_index=(part_major_rows(hk, [r, r]),))
    _map_common(wm, prefix, layer)


def map_deltanet_split(wm: WeightMap, prefix: str, layer: GatedDeltaNet) -> None:
    """Qwen3.5's names: ``in_proj_qkv`` (all q, all k, all v), ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``."""
    rows = 0
    for name, size in (("in_proj_qkv", layer.conv_dim), ("in_proj_z", layer.value_dim),
                       ("in_proj_b", layer.num_v_heads), ("in_proj_a", layer.num_v_heads)):
        wm.add(f"{prefix}.{name}.weight", layer.in_proj.weight, (slice(rows, rows + size),))
        rows += size
    _map_common(wm, prefix, layer)


def _map_common(wm: WeightMap, prefix: str, layer: GatedDeltaNet) -> None:
    c, kw = layer.conv_weight.shape
    wm.add(f"{prefix}.conv1d.weight", layer.conv_weight, src_shape=(c, 1, kw),
           src_index=(slice(None), 0))
    wm.add(f"{prefix}.A_log", layer.A_log)
    wm.add(f"{prefix}.dt_bias", layer.dt_bias)
    wm.add(f"{prefix}.norm.weight", layer.norm.weight)
    wm.add(f"{prefix}.out_proj.weight", layer.out_proj.weight)
