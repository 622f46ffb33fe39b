"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA attention with per-head q/k RMSNorm, top-k softmax MoE.

Shapes: T tokens in the flat batch, E experts (E_local on this rank), K top-k, H hidden,
I expert FFN width, Hq / Hkv query / kv heads of width D, V vocab, NB x BS KV slots.

Invariants: one file, single-device; expert parallelism enters only through ``ParallelInfo``
(the MoE block's ``ep_comm``). Layers whose index is in ``mlp_only_layers``, or not on the
``decoder_sparse_step`` grid, are dense SwiGLU MLPs. Weight names are the ones
``save_pretrained`` writes (per-expert ``mlp.experts.{e}.{gate,up,down}_proj``).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from epserve.kernels.attention import AttentionMetadata
from epserve.models.config import ModelConfig
from epserve.models.layers import (Attention, DenseMLP, RMSNorm, RotaryEmbedding, SparseMoeBlock,
                                   WeightMap, map_attention, map_dense_mlp, map_experts)
from epserve.models.parallel import ParallelInfo

KVCache = tuple[torch.Tensor, torch.Tensor]


class Qwen3MoeDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + moe_or_mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, parallel: ParallelInfo):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)  # cfg.qk_norm is True for Qwen3
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = SparseMoeBlock(cfg, parallel)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata, rope: RotaryEmbedding):
        """hidden, residual: [T, H] (residual None at the first layer). Returns (hidden, residual)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, rope)  # [T, H]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual  # [T, H], [T, H]


class Qwen3MoeForCausalLM(nn.Module):
    """Embedding, ``num_layers`` decoder layers, final norm, LM head (maybe tied)."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelInfo = ParallelInfo()):
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(cfg, i, parallel) for i in range(cfg.num_layers))
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
            if isinstance(layer.mlp, SparseMoeBlock):
                wm.add(f"{p}.mlp.gate.weight", layer.mlp.gate.weight)
                map_experts(wm, f"{p}.mlp.experts", layer.mlp.experts, cfg.num_experts,
                            ("gate_proj", "up_proj", "down_proj"), fused_prefix=f"{p}.mlp.experts")
            else:
                map_dense_mlp(wm, f"{p}.mlp", layer.mlp)
        return wm
