"""The model shapes the GPU benches run with random weights, and what one decode step must read.

``qwen3-30b-a3b``: Qwen3-MoE, 48 layers, 128 experts, top-8. ``qwen3.5-35b-a3b``: the default
``Qwen3_5MoeTextConfig`` of transformers (40 layers, three gated-DeltaNet layers to every gated
full-attention layer, 256 experts, top-8, a gated shared expert). ``active_bytes`` counts the
bytes a batch-1 decode step reads (bf16 weights; a DeltaNet layer's float32 recurrent state read
and written); ``hf_config`` builds transformers' config of a shape (the oracle's and the
baseline's model).
"""

from __future__ import annotations

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                    "full_attention"] * 10,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3.5-35b-a3b": QWEN3_5_35B_A3B}


def shape(name: str, layers: int | None = None) -> dict:
    """The config of shape ``name``, cut to ``layers`` layers (its layer pattern too)."""
    cfg = dict(SHAPES[name])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:layers]
    return cfg


def active_bytes(cfg: dict) -> float:
    """Bytes one decode step must read at batch 1 (bf16 weights): each layer's token mixer
    (attention, or a DeltaNet layer's projections plus its state read and written), the
    router, the top-k experts and a shared expert, and the LM head."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d, hq, hkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    gated = "layer_types" in cfg  # Qwen3.5 / Qwen3-Next attention: q_proj carries a gate too
    attn = h * d * (hq * (2 if gated else 1) + 2 * hkv) + hq * d * h
    types = cfg.get("layer_types") or ["full_attention"] * layers
    mixers = 0.0
    for t in types[:layers]:
        if t == "full_attention":
            mixers += 2.0 * attn
            continue
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv = 2 * hk * dk + hv * dv
        proj = h * (conv + hv * dv + 2 * hv) + hv * dv * h + conv * cfg["linear_conv_kernel_dim"]
        mixers += 2.0 * proj + 2 * 4.0 * hv * dk * dv  # state: float32, read and written
    ffn = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"] + h * cfg["num_experts"]
    ffn += 3 * h * cfg.get("shared_expert_intermediate_size", 0)
    return mixers + 2.0 * (layers * ffn + cfg["vocab_size"] * h)


def hf_config(cfg: dict):
    """transformers' config object of ``cfg``."""
    from transformers import AutoConfig

    return AutoConfig.for_model(cfg["model_type"], **{
        k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
