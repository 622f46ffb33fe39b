"""Mixtral (MixtralForCausalLM): GQA attention, optional sliding window, top-2-of-8 softmax MoE.

Shapes: T tokens in the flat batch, E experts (E_local on this rank), K top-k, H hidden,
I expert FFN width, Hq / Hkv query / kv heads of width D, V vocab, NB x BS KV slots.

Invariants: one file, single-device; expert parallelism enters only through ``ParallelInfo``
(the MoE block's ``ep_comm``). Every layer is a sparse MoE block and the router always
renormalises its top-k weights. Weight names are the ones ``save_pretrained`` writes
(per-expert ``block_sparse_moe.experts.{e}.{w1,w3,w2}``: w1 gate, w3 up, w2 down).
"""

from __future__ import annotations

from torch import nn

from epserve.models.causal_lm import DecoderOnlyLM
from epserve.models.config import ModelConfig
from epserve.models.layers import SparseMoeBlock, WeightMap, map_experts
from epserve.models.parallel import ParallelInfo


class MixtralForCausalLM(DecoderOnlyLM):
    """Every block: GQA attention (no q/k norm; ``cfg.sliding_window`` may be set), then a
    sparse MoE whose router renormalises its top-k weights."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelInfo = ParallelInfo()):
        super().__init__(cfg, parallel, lambda i: SparseMoeBlock(cfg, parallel))

    def map_ffn(self, wm: WeightMap, prefix: str, ffn: nn.Module) -> None:
        router = f"{prefix}.block_sparse_moe.gate.weight"
        wm.add(router, ffn.gate.weight)
        # transformers 5 keeps the MoE under ``mlp`` in memory; accept those names too.
        wm.add(f"{prefix}.mlp.gate.weight", ffn.gate.weight, provides=(router,), required=False)
        map_experts(wm, f"{prefix}.block_sparse_moe.experts", ffn.experts, self.cfg.num_experts,
                    ("w1", "w3", "w2"), fused_prefix=f"{prefix}.mlp.experts")
