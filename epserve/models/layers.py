"""Blocks shared by the MoE decoder architectures, and the checkpoint-name -> parameter map.

Invariants: layers work on a flat batch (``T`` rows, no batch dimension) and never call
``torch.distributed``: with ``world_size > 1`` the MoE block hands its local expert compute to
``parallel.ep_comm``. Expert weights are stacked per rank, ``w13: [E_local, 2I, H]`` (gate rows
then up rows) and ``w2: [E_local, H, I]``. Every checkpoint tensor is shape-checked before it is
copied, and every missing one is reported by its checkpoint name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from epserve.kernels.attention import AttentionMetadata
from epserve.kernels.linear import linear
from epserve.kernels.moe import RoutedPairs, fused_moe, fused_moe_pairs, token_classes
from epserve.kernels.norm import (fused_add_rms_norm, fused_add_zero_centred_rms_norm, rms_norm,
                                  zero_centred_rms_norm)
from epserve.kernels.rope import apply_rope, build_rope_cache
from epserve.kernels.rope_attention import rope_and_attend
from epserve.kernels.router import add_norm_router, topk_softmax
from epserve.models.config import CheckpointError, ModelConfig
from epserve.models.parallel import ParallelInfo

# --------------------------------------------------------------------------- norm and rope


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; with ``residual`` it first adds it (the fused pre-norm step).

    ``forward(x)`` -> normed; ``forward(x, residual)`` -> ``(normed, x + residual)``.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored around 0 and applied as ``1 + weight`` (Qwen3-Next,
    Qwen3.5); the same calls as ``RMSNorm``, the residual added first when given (one launch
    on the Triton path, the 1 added to the weight in float32 inside it)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return zero_centred_rms_norm(x, self.weight, self.eps)
        return fused_add_zero_centred_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """The float32 cos/sin cache ``[max_positions, R/2]``, shared by every attention layer; R
    is the rotated dims of a head (its head dim, or fewer with partial rotary)."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float):
        super().__init__()
        cos, sin = build_rope_cache(rotary_dim, max_positions, theta)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions: [T] int64; q: [T, Hq, D]; k: [T, Hkv, D]. Returns rotated (q, k)."""
        return apply_rope(q, k, positions, self.cos_cache, self.sin_cache)


# --------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache; optional per-head q/k RMSNorm (Qwen3).

    q, k and v come from one fused projection ``qkv_proj`` (rows: Hq*D of q, then Hkv*D of k,
    then Hkv*D of v; the checkpoint's q_proj / k_proj / v_proj load into those slices): one
    GEMM instead of three. q and k are normed and rotated in place inside its output, and the
    same kernel writes the rotated k and v into the paged KV cache.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = d ** -0.5
        self.sliding_window = cfg.sliding_window

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                rope: RotaryEmbedding) -> torch.Tensor:
        """x: [T, H]; kv_cache: ([NB, BS, Hkv, D], same). Writes this step's K/V; returns [T, H]."""
        t = x.shape[0]
        qkv = linear(x, self.qkv_proj.weight)  # [T, (Hq + 2 Hkv) D]; one row: Triton GEMV
        qs, ks = self.q_size, self.kv_size
        q = qkv[:, :qs].view(t, self.num_heads, self.head_dim)  # [T, Hq, D] views
        k = qkv[:, qs:qs + ks].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = qkv[:, qs + ks:].view(t, self.num_kv_heads, self.head_dim)
        # Per-head q/k RMSNorm (Qwen3; None skips it) and rope, in place, plus this step's K/V
        # into the paged cache (slot -1 rows write nothing), then paged attention: one launch
        # for a pure decode step on the Triton path, else two.
        qw = None if self.q_norm is None else self.q_norm.weight
        kw = None if self.k_norm is None else self.k_norm.weight
        eps = self.q_norm.eps if self.q_norm is not None else 1e-6
        k_cache, v_cache = kv_cache
        out = rope_and_attend(q, k, v, positions, rope.cos_cache, rope.sin_cache, qw, kw, eps,
                              k_cache, v_cache, meta, self.scale, self.sliding_window)
        return linear(out.reshape(t, self.num_heads * self.head_dim), self.o_proj.weight)  # [T, H]


# --------------------------------------------------------------------------- MoE and MLP


class TopKRouter(nn.Module):
    """Softmax over the E experts, keep the top K; optionally renormalise the K weights to 1."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H]. Returns topk_ids: [T, K] int64, topk_weights: [T, K] float32 (ties go
        to the lower expert id)."""
        return topk_softmax(F.linear(x, self.weight), self.top_k, self.renormalize)


class StackedExperts(nn.Module):
    """This rank's experts ``[expert_start, expert_end)`` as stacked SwiGLU weights.

    Calling it is the ``local_fn`` of expert parallelism: ``(x [N, H], topk_ids [N, K] int64
    global ids, topk_weights [N, K] float32) -> [N, H]``, the weighted sum over the routed
    experts this rank holds (others count zero), so summing every rank's result gives the MoE.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 parallel: ParallelInfo):
        super().__init__()
        self.expert_start, self.expert_end = parallel.local_expert_range(num_experts)
        n_local = self.expert_end - self.expert_start
        self.w13 = nn.Parameter(torch.empty(n_local, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(n_local, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.w13, self.w2, topk_ids, topk_weights, expert_offset=self.expert_start)

    def pairs(self, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor | RoutedPairs:
        """``forward`` with the combine left to the caller where the Triton pipeline runs
        (``fused_moe_pairs``)."""
        return fused_moe_pairs(x, self.w13, self.w2, topk_ids, topk_weights,
                               expert_offset=self.expert_start)


class SparseMoeBlock(nn.Module):
    """Route each token to K of E experts and sum their weighted outputs (local or via EP comm).

    With ``world_size > 1`` it calls ``parallel.ep_comm.moe_forward(x, topk_ids, topk_weights,
    local_fn)``: the comm dispatches rows to the ranks owning their experts, runs each rank's
    ``local_fn`` (``StackedExperts``) on what it received, and combines the partial sums back.
    """

    def __init__(self, cfg: ModelConfig, parallel: ParallelInfo):
        super().__init__()
        self.parallel = parallel
        self.gate = TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob)
        self.experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                      parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H]. Returns [T, H]."""
        topk_ids, topk_weights = self.gate(x)  # [T, K], [T, K]
        return self.run_experts(x, topk_ids, topk_weights)

    def forward_prenorm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                        row_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(x, residual))`` with the residual add, the norm and the router in one
        launch at decode sizes (``add_norm_router``). x, residual: [T, H]; row_slots: [T] KV
        slots (a negative slot marks a padding row of a CUDA graph: on one rank it may route
        to no expert, its output is never read). Returns ``(moe output, new residual)``."""
        hidden, residual, topk_ids, topk_weights = self.route_prenorm(x, residual, norm,
                                                                      row_slots)
        return self.run_experts(hidden, topk_ids, topk_weights), residual

    def warmup_token_counts(self, max_tokens: int) -> list[int]:
        """Step sizes (tokens) whose forwards, together, launch every variant of this block's
        kernels that a step of up to ``max_tokens`` tokens can (``worker.warmup``)."""
        return token_classes(max_tokens, self.gate.top_k, self.experts.w13)

    def route_prenorm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                      row_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The residual add, ``norm`` (an ``RMSNorm`` or a ``ZeroCentredRMSNorm``) and the
        router as one launch: ``(normed, new residual, topk_ids, topk_weights)``."""
        if self.parallel.world_size > 1:  # the EP exchange dispatches every row by its ids
            row_slots = None
        return add_norm_router(x, residual, norm.weight, norm.eps, self.gate.weight,
                               self.gate.top_k, self.gate.renormalize, row_slots,
                               zero_centred=isinstance(norm, ZeroCentredRMSNorm))

    def run_experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    pairs: bool = False) -> torch.Tensor | RoutedPairs:
        """The routed experts of ``x`` (this rank's, or through the EP exchange): [T, H]. With
        ``pairs`` on one rank, ``StackedExperts.pairs``: the pair rows uncombined where the
        Triton pipeline runs, for a caller that sums them in its own launch."""
        if self.parallel.world_size == 1:
            run = self.experts.pairs if pairs else self.experts
            return run(x, topk_ids, topk_weights)
        comm = self.parallel.ep_comm
        if comm is None:
            raise RuntimeError(f"SparseMoeBlock: world_size={self.parallel.world_size} but "
                               "ParallelInfo.ep_comm is None; an EP communicator is required to "
                               "reach the experts held by other ranks")
        return comm.moe_forward(x, topk_ids, topk_weights, self.experts)


class DenseMLP(nn.Module):
    """A dense SwiGLU MLP (Qwen3's non-MoE layers): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H]. Returns [T, H] (one-row steps through the Triton GEMV, ``linear``)."""
        gate_up = linear(x, self.gate_up_proj.weight)  # [T, 2I]
        i = self.intermediate_size
        return linear(F.silu(gate_up[:, :i]) * gate_up[:, i:], self.down_proj.weight)


def moe_or_dense(cfg: ModelConfig, parallel: ParallelInfo, layer_idx: int,
                 moe_block: type[nn.Module] = SparseMoeBlock) -> nn.Module:
    """Layer ``layer_idx``'s feed-forward: ``moe_block(cfg, parallel)`` where
    ``cfg.is_moe_layer``, else a dense SwiGLU MLP of ``cfg.intermediate_size``."""
    if cfg.is_moe_layer(layer_idx):
        return moe_block(cfg, parallel)
    return DenseMLP(cfg.hidden_size, cfg.intermediate_size)


# --------------------------------------------------------------------------- weight mapping


@dataclass(frozen=True)
class _Entry:
    dest: torch.Tensor  # a view into a parameter
    src_shape: tuple[int, ...]  # the checkpoint tensor's expected shape
    src_index: tuple | None  # the part of the checkpoint tensor to copy (None: all of it)
    provides: tuple[str, ...]  # required checkpoint names this tensor stands for


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


class WeightMap:
    """Checkpoint tensor names -> parameter views for one model on one rank.

    ``add`` registers a name this rank loads; ``skip`` a name another rank loads. ``load``
    copies each known tensor after checking its shape, ignores unknown names (rotary buffers,
    ...) unless they name a layer or expert beyond the config, and at the end raises
    ``CheckpointError`` listing every required name that never arrived.
    """

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers, self.num_experts = num_layers, num_experts
        self._entries: dict[str, _Entry] = {}
        self._skipped: set[str] = set()
        self._required: set[str] = set()

    def add(self, name: str, param: torch.Tensor, index: tuple = (), *,
            src_shape: tuple[int, ...] | None = None,
            src_index: tuple | None = None, provides: tuple[str, ...] | None = None,
            required: bool = True) -> None:
        """Load checkpoint ``name`` (its ``src_index`` part) into ``param[index]``."""
        dest = param.detach()[index] if index else param.detach()
        shape = tuple(dest.shape) if src_shape is None else tuple(src_shape)
        self._entries[name] = _Entry(dest, shape, src_index, (name,) if provides is None else provides)
        if required:
            self._required.add(name)

    def skip(self, name: str) -> None:
        self._skipped.add(name)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen: set[str] = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                entry = self._entries.get(name)
                if entry is None:
                    self._check_unknown(name)
                    continue
                if tuple(tensor.shape) != entry.src_shape:
                    raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                          f"expected {entry.src_shape}")
                src = tensor if entry.src_index is None else tensor[entry.src_index]
                entry.dest.copy_(src)
                seen.update(entry.provides)
        missing = sorted(self._required - seen, key=_natural_key)
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing)}")

    def _check_unknown(self, name: str) -> None:
        if name in self._skipped:
            return
        layer = _LAYER_RE.search(name)
        if layer and int(layer.group(1)) >= self.num_layers:
            raise CheckpointError(f"unexpected tensor {name!r}: layer {layer.group(1)} does not exist "
                                  f"(config has num_layers={self.num_layers})")
        expert = _EXPERT_RE.search(name)
        if expert and int(expert.group(1)) >= self.num_experts:
            raise CheckpointError(f"unexpected tensor {name!r}: expert {expert.group(1)} does not "
                                  f"exist (config has num_experts={self.num_experts})")


def _natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def part_major_rows(num_groups: int, sizes: list[int]) -> torch.Tensor:
    """Row order that regroups a checkpoint tensor stored group-major (each of ``num_groups``
    groups holds ``sizes[0]`` rows of part 0, then ``sizes[1]`` rows of part 1, ...) as
    part-major (every group's part 0, then every group's part 1, ...): pass it as a
    ``WeightMap.add`` ``src_index``. Per-head interleaved projections load this way."""
    base = torch.arange(num_groups)[:, None] * sum(sizes)  # [G, 1]: each group's first row
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    return torch.cat([(base + a + torch.arange(n)).flatten() for a, n in zip(starts, sizes)])


def map_attention(wm: WeightMap, prefix: str, attn: Attention) -> None:
    """``{prefix}.{q,k,v}_proj.weight`` into slices of the fused qkv projection,
    ``{prefix}.o_proj.weight`` and, with qk-norm, ``{prefix}.{q,k}_norm.weight``."""
    qs, ks = attn.q_size, attn.kv_size
    for proj, rows in (("q_proj", slice(0, qs)), ("k_proj", slice(qs, qs + ks)),
                       ("v_proj", slice(qs + ks, qs + 2 * ks))):
        wm.add(f"{prefix}.{proj}.weight", attn.qkv_proj.weight, (rows,))
    wm.add(f"{prefix}.o_proj.weight", attn.o_proj.weight)
    if attn.q_norm is not None:
        wm.add(f"{prefix}.q_norm.weight", attn.q_norm.weight)
        wm.add(f"{prefix}.k_norm.weight", attn.k_norm.weight)


def map_dense_mlp(wm: WeightMap, prefix: str, mlp: DenseMLP) -> None:
    """``{prefix}.{gate,up,down}_proj.weight`` onto the fused gate_up / down projections."""
    i = mlp.intermediate_size
    wm.add(f"{prefix}.gate_proj.weight", mlp.gate_up_proj.weight, (slice(0, i),))
    wm.add(f"{prefix}.up_proj.weight", mlp.gate_up_proj.weight, (slice(i, 2 * i),))
    wm.add(f"{prefix}.down_proj.weight", mlp.down_proj.weight)


def map_experts(wm: WeightMap, prefix: str, experts: StackedExperts, num_experts: int,
                names: tuple[str, str, str], fused_prefix: str) -> None:
    """Per-expert ``{prefix}.{e}.{gate,up,down}.weight`` for local experts (others skipped), and
    the fused ``{fused_prefix}.gate_up_proj`` [E, 2I, H] / ``.down_proj`` [E, H, I] that stand in
    for all of them."""
    gate, up, down = names
    start, end = experts.expert_start, experts.expert_end
    n_local, two_i, h = experts.w13.shape
    i = two_i // 2
    gate_up_names, down_names = [], []
    for e in range(num_experts):
        g, u, d = (f"{prefix}.{e}.{n}.weight" for n in (gate, up, down))
        if not start <= e < end:
            for n in (g, u, d):
                wm.skip(n)
            continue
        j = e - start
        wm.add(g, experts.w13, (j, slice(0, i)))
        wm.add(u, experts.w13, (j, slice(i, two_i)))
        wm.add(d, experts.w2, (j,))
        gate_up_names += [g, u]
        down_names.append(d)
    local = (slice(start, end),)
    wm.add(f"{fused_prefix}.gate_up_proj", experts.w13, src_shape=(num_experts, two_i, h),
           src_index=local, provides=tuple(gate_up_names), required=False)
    wm.add(f"{fused_prefix}.down_proj", experts.w2, src_shape=(num_experts, h, i),
           src_index=local, provides=tuple(down_names), required=False)
