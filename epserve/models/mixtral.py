"""Mixtral (MixtralForCausalLM): GQA attention, optional sliding window, top-2-of-8 softmax MoE.

Shapes: T tokens in the flat batch, E experts (E_local on this rank), K top-k, H hidden,
I expert FFN width, Hq / Hkv query / kv heads of width D, V vocab, NB x BS KV slots.

Invariants: one file, single-device; expert parallelism enters only through ``ParallelInfo``
(the MoE block's ``ep_comm``). Every layer is a sparse MoE block and the router always
renormalises its top-k weights. Weight names are the ones ``save_pretrained`` writes
(per-expert ``block_sparse_moe.experts.{e}.{w1,w3,w2}``: w1 gate, w3 up, w2 down).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from epserve.kernels.attention import AttentionMetadata
from epserve.models.config import ModelConfig
from epserve.models.layers import (Attention, RMSNorm, RotaryEmbedding, SparseMoeBlock, WeightMap,
                                   map_attention, map_experts)
from epserve.models.parallel import ParallelInfo

KVCache = tuple[torch.Tensor, torch.Tensor]


class MixtralDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + moe(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, parallel: ParallelInfo):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)  # no q/k norm; cfg.sliding_window may be set
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block_sparse_moe = SparseMoeBlock(cfg, parallel)  # router renormalises top-k

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata, rope: RotaryEmbedding):
        """hidden, residual: [T, H] (residual None at the first layer). Returns (hidden, residual)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, rope)  # [T, H]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.block_sparse_moe(hidden), residual  # [T, H], [T, H]


class MixtralForCausalLM(nn.Module):
    """Embedding, ``num_layers`` decoder layers, final norm, LM head (maybe tied)."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelInfo = ParallelInfo()):
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MixtralDecoderLayer(cfg, i, parallel) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_caches: one ([NB, BS, Hkv, D], same) per layer.

        Writes this step's K/V into the caches; returns hidden: [T, H] after the final norm.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.rope)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, H]. Returns logits: [R, V] float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (this rank's experts only); ``CheckpointError`` on a wrong
        shape or, at the end, on every missing tensor."""
        self._weight_map().load(named_tensors)

    def _weight_map(self) -> WeightMap:
        cfg = self.cfg
        wm = WeightMap(cfg.num_layers, cfg.num_experts)
        wm.add("model.embed_tokens.weight", self.embed_tokens.weight)
        wm.add("model.norm.weight", self.norm.weight)
        if not cfg.tie_word_embeddings:
            wm.add("lm_head.weight", self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            wm.add(f"{p}.input_layernorm.weight", layer.input_layernorm.weight)
            wm.add(f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
            map_attention(wm, f"{p}.self_attn", layer.self_attn)
            moe, router = layer.block_sparse_moe, f"{p}.block_sparse_moe.gate.weight"
            wm.add(router, moe.gate.weight)
            # transformers 5 keeps the MoE under ``mlp`` in memory; accept those names too.
            wm.add(f"{p}.mlp.gate.weight", moe.gate.weight, provides=(router,), required=False)
            map_experts(wm, f"{p}.block_sparse_moe.experts", moe.experts, cfg.num_experts,
                        ("w1", "w3", "w2"), fused_prefix=f"{p}.mlp.experts")
        return wm
