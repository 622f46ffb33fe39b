"""The decoder-only shell every MoE family shares: embed, pre-norm blocks, final norm, LM head.

Shapes: T tokens in the flat batch, H hidden, V vocab. Invariants: single-device code; a
block is x + mixer(norm(x)) then x + ffn(norm(x)) with the residual carried through the fused
add+norm; an architecture file says only what differs (its blocks, norms and weight names).
Each block describes the cache it keeps between steps (``cache_spec``), so
``layer_cache_specs`` tells the runner what to allocate for any architecture.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from epserve.kernels.attention import AttentionMetadata
from epserve.models.config import ModelConfig
from epserve.models.layer_cache import KvCacheSpec, LayerCacheSpec
from epserve.models.layers import Attention, RMSNorm, RotaryEmbedding, WeightMap, map_attention
from epserve.models.parallel import ParallelInfo

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), or a linear layer's states


class DecoderLayer(nn.Module):
    """Pre-norm block around ``self_attn`` and ``ffn`` (a MoE block or a dense MLP)."""

    def __init__(self, cfg: ModelConfig, ffn: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = ffn

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata, rope: RotaryEmbedding):
        """hidden, residual: [T, H] (residual None at the first layer). Returns (hidden, residual)."""
        return pre_norm_block(self, self.self_attn, positions, hidden, residual, kv_cache, meta,
                              rope)

    def cache_spec(self) -> KvCacheSpec:
        return KvCacheSpec(self.self_attn.num_kv_heads, self.self_attn.head_dim)


def pre_norm_block(layer: nn.Module, mixer: nn.Module, positions: torch.Tensor,
                   hidden: torch.Tensor, residual: torch.Tensor | None, cache: KVCache,
                   meta: AttentionMetadata, rope: nn.Module):
    """One pre-norm block: ``x + mixer(norm(x))`` then ``x + ffn(norm(x))`` with the residual
    carried through the fused add+norm (``layer``'s ``input_layernorm``,
    ``post_attention_layernorm`` and ``ffn``). A feed-forward with ``forward_prenorm`` (a MoE
    block) takes the second add+norm itself: its router fuses with it. Returns (hidden,
    residual), [T, H] each."""
    if residual is None:
        residual, hidden = hidden, layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    hidden = mixer(positions, hidden, cache, meta, rope)  # [T, H]
    prenorm = getattr(layer.ffn, "forward_prenorm", None)
    if prenorm is not None:
        return prenorm(hidden, residual, layer.post_attention_layernorm, meta.slot_mapping)
    hidden, residual = layer.post_attention_layernorm(hidden, residual)
    return layer.ffn(hidden), residual


class DecoderOnlyLM(nn.Module):
    """Embedding, ``num_layers`` blocks (``make_ffn(i)`` gives block i's feed-forward), final
    norm, LM head (maybe tied). Subclasses name their feed-forward weights in ``map_ffn``; an
    architecture with other blocks overrides ``make_layer`` / ``map_layer`` (and ``norm_class``,
    ``checkpoint_prefix``: where the language model's tensors sit in the checkpoint)."""

    norm_class: type[nn.Module] = RMSNorm
    checkpoint_prefix = "model."

    def __init__(self, cfg: ModelConfig, parallel: ParallelInfo,
                 make_ffn: Callable[[int], nn.Module]):
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(i, make_ffn(i)) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def make_layer(self, layer_idx: int, ffn: nn.Module) -> nn.Module:
        """Block ``layer_idx`` around its feed-forward ``ffn``."""
        return DecoderLayer(self.cfg, ffn)

    def layer_cache_specs(self) -> tuple[LayerCacheSpec, ...]:
        """What each layer keeps between steps, in layer order: the runner allocates one cache
        per entry and passes them to ``forward`` in the same order."""
        return tuple(layer.cache_spec() for layer in self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_caches: one per layer, as ``layer_cache_specs``
        says: ``(k_cache, v_cache)`` [NB, BS, Hkv, D] for attention, ``(conv_state,
        recurrent_state)`` for a linear-attention layer (``meta.state_slots`` picks the slots).

        Writes this step's K/V (and states) into the caches; returns hidden: [T, H] after the
        final norm.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        hidden = self.embed_tokens(input_ids)  # [T, H]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.rope)
        if residual is None:  # no layers
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, H]. Returns logits: [R, V] float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (this rank's experts only); ``CheckpointError`` on a wrong
        shape or, at the end, on every missing tensor."""
        self.weight_map().load(named_tensors)

    def weight_map(self) -> WeightMap:
        cfg, p = self.cfg, self.checkpoint_prefix
        wm = WeightMap(cfg.num_layers, cfg.num_experts)
        wm.add(f"{p}embed_tokens.weight", self.embed_tokens.weight)
        wm.add(f"{p}norm.weight", self.norm.weight)
        if not cfg.tie_word_embeddings:
            wm.add("lm_head.weight", self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            self.map_layer(wm, f"{p}layers.{i}", layer)
        return wm

    def map_layer(self, wm: WeightMap, prefix: str, layer: nn.Module) -> None:
        """Block ``layer``'s checkpoint names under ``prefix`` (``model.layers.{i}``)."""
        wm.add(f"{prefix}.input_layernorm.weight", layer.input_layernorm.weight)
        wm.add(f"{prefix}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        map_attention(wm, f"{prefix}.self_attn", layer.self_attn)
        self.map_ffn(wm, prefix, layer.ffn)

    def map_ffn(self, wm: WeightMap, prefix: str, ffn: nn.Module) -> None:
        raise NotImplementedError
