"""Gated-DeltaNet hybrid MoE models: Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5-MoE
(Qwen3_5MoeForCausalLM, and the language model of Qwen3_5MoeForConditionalGeneration).

Shapes: T tokens in the flat batch, H hidden, E experts, V vocab.

Each block: a zero-centred pre-norm, its token mixer (``layer_types``: a gated DeltaNet with
per-sequence states, or gated full attention with partial rotary over the paged KV cache), a
zero-centred pre-norm, then a MoE with a gated shared expert (or, on the layers Qwen3-Next
keeps dense, a SwiGLU MLP); the final norm is zero-centred too.

Invariants: expert parallelism enters only through ``ParallelInfo`` (the routed experts are
sharded over EP ranks by the MoE block's ``ep_comm``; the shared expert runs on every rank for
its own rows). The two families differ in their DeltaNet projections' names (grouped per key
head in Qwen3-Next, split in Qwen3.5) and Qwen3.5 has no dense layers. A
``...ForConditionalGeneration`` checkpoint's language model sits under
``model.language_model.``; its vision tensors are skipped with one log line.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from epserve.kernels.attention import AttentionMetadata, StateRuns
from epserve.kernels.shared_expert import shared_expert_add
from epserve.models.causal_lm import DecoderOnlyLM, pre_norm_block
from epserve.models.config import ModelConfig
from epserve.models.gated_attention import GatedAttention, map_gated_attention
from epserve.models.gated_deltanet import (GatedDeltaNet, fold_runs, map_deltanet_grouped,
                                           map_deltanet_split)
from epserve.models.layer_cache import LayerCacheSpec
from epserve.models.layers import (DenseMLP, RotaryEmbedding, SparseMoeBlock, WeightMap,
                                   ZeroCentredRMSNorm, map_dense_mlp, map_experts, moe_or_dense)
from epserve.models.parallel import ParallelInfo

log = logging.getLogger(__name__)


class SharedExpertMoeBlock(nn.Module):
    """The routed experts ``routed`` (softmax top-k, renormalised when ``norm_topk_prob``;
    sharded over EP ranks) plus a dense shared expert scaled by
    ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelInfo):
        super().__init__()
        self.routed = SparseMoeBlock(cfg, parallel)
        self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H]. Returns [T, H]."""
        return self._add_shared(x, *self.routed.gate(x))

    def forward_prenorm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                        row_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(norm(x, residual))`` with the residual add, the zero-centred norm and the
        router in one launch at decode sizes (``SparseMoeBlock.route_prenorm``). Returns
        ``(output, new residual)``."""
        hidden, residual, ids, weights = self.routed.route_prenorm(x, residual, norm, row_slots)
        return self._add_shared(hidden, ids, weights), residual

    def _add_shared(self, x: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        """``routed + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (``shared_expert_add``:
        two launches at one row on the Triton path, which on one rank also sum the routed
        experts' pair rows, so the MoE's combine launch goes; the eager ops otherwise)."""
        routed = self.routed.run_experts(x, topk_ids, topk_weights, pairs=True)
        mlp = self.shared_expert
        return shared_expert_add(x, routed, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                                 self.shared_expert_gate.weight)


class HybridDecoderLayer(nn.Module):
    """Zero-centred pre-norm block around ``mixer`` (``GatedDeltaNet`` or ``GatedAttention``)
    and ``ffn``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ffn: nn.Module):
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer: GatedDeltaNet | GatedAttention = (
            GatedDeltaNet(cfg) if cfg.is_linear_attention(layer_idx) else GatedAttention(cfg))
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = ffn

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                rope: RotaryEmbedding):
        """hidden, residual: [T, H] (residual None at the first layer); cache: this layer's KV
        cache or states. Returns (hidden, residual)."""
        return pre_norm_block(self, self.mixer, positions, hidden, residual, cache, meta, rope)

    def cache_spec(self) -> LayerCacheSpec:
        return self.mixer.cache_spec()


class _HybridMoeLM(DecoderOnlyLM):
    """The shared model; subclasses say how their DeltaNet projections are named."""

    norm_class = ZeroCentredRMSNorm
    map_deltanet: Callable[[WeightMap, str, GatedDeltaNet], None]
    #: checkpoint tensors this model does not use yet, by name prefix, with the log line's why
    unused: dict[str, str] = {
        "mtp.": "MTP head weights, for speculative_config method 'mtp' only"}  # models.mtp

    def __init__(self, cfg: ModelConfig, parallel: ParallelInfo = ParallelInfo()):
        super().__init__(cfg, parallel,
                         lambda i: moe_or_dense(cfg, parallel, i, SharedExpertMoeBlock))

    def make_layer(self, layer_idx: int, ffn: nn.Module) -> nn.Module:
        return HybridDecoderLayer(self.cfg, layer_idx, ffn)

    def fold_held_states(self, caches: list, meta: AttentionMetadata, kept: list[int]) -> None:
        """After a step with held runs (``meta.state_runs``, a speculative verify's), advance
        each one's DeltaNet states by its first ``kept[i]`` tokens (the fed token and the
        accepted drafts), layer by layer from ``StateRuns.log``."""
        runs = meta.state_runs
        if runs is None:
            raise ValueError("fold: the step held no recurrent state")
        self.fold_logged(caches, runs.log, *fold_runs(runs, kept))

    def fold_logged(self, caches: list, logged: list, fold: StateRuns, first: int) -> None:
        """Each DeltaNet layer's ``fold`` of its entry of ``logged`` (``StateRuns.log``) over
        ``fold`` from row ``first`` (``gated_deltanet.fold_runs``)."""
        entries = iter(logged)
        for layer, cache in zip(self.layers, caches):
            if isinstance(layer.mixer, GatedDeltaNet):
                layer.mixer.fold(next(entries), cache, fold, first)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load, leaving out (with one log line each) the tensors under ``unused``."""
        skipped: dict[str, int] = dict.fromkeys(self.unused, 0)

        def used() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                prefix = next((p for p in skipped if name.startswith(p)), None)
                if prefix is None:
                    yield name, tensor
                else:
                    skipped[prefix] += 1

        super().load_weights(used())
        for prefix, n in skipped.items():
            if n:
                log.info("%s: %d tensors under %s", self.unused[prefix], n, prefix)

    def map_layer(self, wm: WeightMap, prefix: str, layer: nn.Module) -> None:
        wm.add(f"{prefix}.input_layernorm.weight", layer.input_layernorm.weight)
        wm.add(f"{prefix}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        if isinstance(layer.mixer, GatedDeltaNet):
            self.map_deltanet(wm, f"{prefix}.linear_attn", layer.mixer)
        else:
            map_gated_attention(wm, f"{prefix}.self_attn", layer.mixer)
        ffn, p = layer.ffn, f"{prefix}.mlp"
        if not isinstance(ffn, SharedExpertMoeBlock):
            map_dense_mlp(wm, p, ffn)
            return
        wm.add(f"{p}.gate.weight", ffn.routed.gate.weight)
        map_experts(wm, f"{p}.experts", ffn.routed.experts, self.cfg.num_experts,
                    ("gate_proj", "up_proj", "down_proj"), fused_prefix=f"{p}.experts")
        map_dense_mlp(wm, f"{p}.shared_expert", ffn.shared_expert)
        wm.add(f"{p}.shared_expert_gate.weight", ffn.shared_expert_gate.weight)


class Qwen3NextForCausalLM(_HybridMoeLM):
    """Qwen3-Next: ``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head; dense layers where
    ``mlp_only_layers`` / ``decoder_sparse_step`` say."""

    map_deltanet = staticmethod(map_deltanet_grouped)


class Qwen3_5MoeForCausalLM(_HybridMoeLM):
    """Qwen3.5-MoE's language model: split ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a``."""

    map_deltanet = staticmethod(map_deltanet_split)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """A Qwen3.5-MoE multimodal checkpoint served as its language model (text only)."""

    checkpoint_prefix = "model.language_model."
    unused = {**_HybridMoeLM.unused,
              "model.visual.": "vision weights ignored until vision exists"}

