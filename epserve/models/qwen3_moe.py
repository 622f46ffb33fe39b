"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA attention with per-head q/k RMSNorm, top-k softmax MoE.

Shapes: T tokens in the flat batch, E experts (E_local on this rank), K top-k, H hidden,
I expert FFN width, Hq / Hkv query / kv heads of width D, V vocab, NB x BS KV slots.

Invariants: one file, single-device; expert parallelism enters only through ``ParallelInfo``
(the MoE block's ``ep_comm``). Layers whose index is in ``mlp_only_layers``, or not on the
``decoder_sparse_step`` grid, are dense SwiGLU MLPs. Weight names are the ones
``save_pretrained`` writes (per-expert ``mlp.experts.{e}.{gate,up,down}_proj``).
"""

from __future__ import annotations

from torch import nn

from epserve.models.causal_lm import DecoderOnlyLM
from epserve.models.config import ModelConfig
from epserve.models.layers import (SparseMoeBlock, WeightMap, map_dense_mlp, map_experts,
                                   moe_or_dense)
from epserve.models.parallel import ParallelInfo


class Qwen3MoeForCausalLM(DecoderOnlyLM):
    """Every block: GQA attention with per-head q/k RMSNorm (``cfg.qk_norm``), then a sparse
    MoE (softmax router, top-k, renormalised when ``norm_topk_prob``) or, on the layers the
    config keeps dense, a SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelInfo = ParallelInfo()):
        super().__init__(cfg, parallel, lambda i: moe_or_dense(cfg, parallel, i))

    def map_ffn(self, wm: WeightMap, prefix: str, ffn: nn.Module) -> None:
        if isinstance(ffn, SparseMoeBlock):
            wm.add(f"{prefix}.mlp.gate.weight", ffn.gate.weight)
            map_experts(wm, f"{prefix}.mlp.experts", ffn.experts, self.cfg.num_experts,
                        ("gate_proj", "up_proj", "down_proj"), fused_prefix=f"{prefix}.mlp.experts")
        else:
            map_dense_mlp(wm, f"{prefix}.mlp", ffn)
