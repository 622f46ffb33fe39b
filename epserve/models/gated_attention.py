"""The gated full-attention layer of the gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE).

Shapes: T tokens in the flat batch, H hidden, Hq / Hkv query / kv heads of width D, R rotary
dims (R = D * partial_rotary_factor). It is GQA attention over the paged KV cache as in
``layers.Attention``, with three differences transformers defines:
- ``q_proj`` gives 2 D per query head: the head's query, then its output gate (interleaved
  per head in the checkpoint; loaded here into one block of queries and one of gates);
- q / k are RMS-normed per head with zero-centred weights (``1 + w``);
- only the first R dims of each head rotate (partial rotary), and the attention output is
  multiplied by ``sigmoid(gate)`` before ``o_proj``.

All of that between the two projections is one call, ``rope_and_attend`` with the zero-centred
q/k weights and the gate (a view of the projection, never copied): on CUDA a decode step is one
launch (norms, rope, KV write, attention, gate), any other step two plus the gate in torch.
"""

from __future__ import annotations

import torch
from torch import nn

from epserve.kernels.attention import AttentionMetadata
from epserve.kernels.linear import linear
from epserve.kernels.rope_attention import rope_and_attend
from epserve.models.config import ModelConfig
from epserve.models.layer_cache import KvCacheSpec
from epserve.models.layers import (RotaryEmbedding, WeightMap, ZeroCentredRMSNorm,
                                   part_major_rows)


class GatedAttention(nn.Module):
    """One projection ``qkvg_proj`` (rows: Hq*D queries, Hq*D gates, Hkv*D keys, Hkv*D values),
    per-head zero-centred q/k norms, partial rotary, paged attention, the sigmoid output gate
    and ``o_proj``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkvg_proj = nn.Linear(h, 2 * self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.scale = d ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                rope: RotaryEmbedding) -> torch.Tensor:
        """x: [T, H]; kv_cache: ([NB, BS, Hkv, D], same). Writes this step's K/V; returns [T, H]."""
        t, qs, ks = x.shape[0], self.q_size, self.kv_size
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkvg = linear(x, self.qkvg_proj.weight)  # [T, 2 Hq D + 2 Hkv D]
        q = qkvg[:, :qs].view(t, hq, d)  # [T, Hq, D] views of the projection
        gate = qkvg[:, qs:2 * qs].view(t, hq, d)
        k = qkvg[:, 2 * qs:2 * qs + ks].view(t, hkv, d)
        v = qkvg[:, 2 * qs + ks:].view(t, hkv, d)
        k_cache, v_cache = kv_cache
        # Zero-centred q/k norms and rope (the first R dims) in place, this step's K/V into the
        # paged cache, paged attention, times sigmoid(gate).
        out = rope_and_attend(q, k, v, positions, rope.cos_cache, rope.sin_cache,
                              self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, k_cache,
                              v_cache, meta, self.scale, zero_centred=True, gate=gate)
        return linear(out.reshape(t, qs), self.o_proj.weight)  # [T, H]

    def cache_spec(self) -> KvCacheSpec:
        return KvCacheSpec(self.num_kv_heads, self.head_dim)


def map_gated_attention(wm: WeightMap, prefix: str, attn: GatedAttention) -> None:
    """``{prefix}.q_proj.weight`` [Hq * 2D, H] (per head: D query rows, then D gate rows) into
    the query and gate blocks, ``{k,v,o}_proj`` and the q / k norms."""
    qs, ks, d = attn.q_size, attn.kv_size, attn.head_dim
    wm.add(f"{prefix}.q_proj.weight", attn.qkvg_proj.weight, (slice(0, 2 * qs),),
           src_index=(part_major_rows(attn.num_heads, [d, d]),))  # queries, then gates
    wm.add(f"{prefix}.k_proj.weight", attn.qkvg_proj.weight, (slice(2 * qs, 2 * qs + ks),))
    wm.add(f"{prefix}.v_proj.weight", attn.qkvg_proj.weight, (slice(2 * qs + ks, 2 * qs + 2 * ks),))
    wm.add(f"{prefix}.o_proj.weight", attn.o_proj.weight)
    wm.add(f"{prefix}.q_norm.weight", attn.q_norm.weight)
    wm.add(f"{prefix}.k_norm.weight", attn.k_norm.weight)
