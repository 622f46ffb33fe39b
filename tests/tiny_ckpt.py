"""Tiny random Hugging Face MoE checkpoints for tests, written with transformers' save_pretrained.

Invariants: nothing is downloaded; the same (arch, seed, overrides) gives the same weights; the
weights are scaled up (``initializer_range``) so logits are far from uniform and greedy picks
are not near-ties; ``eos_token_id`` is 2 and ``bos_token_id`` 1. The gated-DeltaNet hybrids
(``qwen3_next``, ``qwen3_5_moe``, and ``qwen3_5_moe_vl``: a Qwen3.5 saved as
``...ForConditionalGeneration`` with a one-block vision tower) have 4 layers, three linear then
one full attention, and their norm weights and ``dt_bias`` jittered off their constant
initial values so that a wrong norm convention shows. They are kept well conditioned, or the
oracle itself drifts past 1e-4 (transformers' prefill against its own token-by-token decode)
and a 1e-4 comparison would test nothing: weights drawn at 0.1 (at 0.25 each layer doubles
the fp32 error of the one before), and DeltaNet decay rates ``A`` in [0.02, 0.3] (transformers
draws up to 16; the chunked form of the rule, transformers' and ours, takes differences of
per-chunk cumulative log decays, which lose fp32 digits as those sums grow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_COMMON: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=1024,
    initializer_range=0.25,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(head_dim=16, num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                      norm_topk_prob=False, rms_norm_eps=1e-6),
    "mixtral": dict(num_local_experts=8, intermediate_size=32, rms_norm_eps=1e-5),
}
_HYBRID: dict[str, Any] = dict(
    num_hidden_layers=4, head_dim=16, num_experts=8, moe_intermediate_size=32,
    shared_expert_intermediate_size=48, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], rms_norm_eps=1e-6,
    initializer_range=0.1)
_ARCH_DEFAULTS.update(qwen3_next=dict(_HYBRID, intermediate_size=96), qwen3_5_moe=_HYBRID,
                      qwen3_5_moe_vl=_HYBRID)
#: The vision tower of ``qwen3_5_moe_vl`` (weights our loader skips).
_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                    patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_vl")


def tiny_config(arch: str, **overrides: Any):
    """The transformers config object of a tiny ``arch`` model (a key of ``_ARCH_DEFAULTS``)."""
    import transformers as tf

    if arch not in _ARCH_DEFAULTS:
        raise ValueError(f"tiny checkpoint arch must be one of {sorted(_ARCH_DEFAULTS)}, "
                         f"got {arch!r}")
    kwargs = {**_COMMON, **_ARCH_DEFAULTS[arch], **overrides}
    if arch == "qwen3_5_moe_vl":
        return tf.Qwen3_5MoeConfig(text_config=kwargs, vision_config=_TINY_VISION,
                                   tie_word_embeddings=kwargs["tie_word_embeddings"])
    classes = {"qwen3_moe": tf.Qwen3MoeConfig, "mixtral": tf.MixtralConfig,
               "qwen3_next": tf.Qwen3NextConfig, "qwen3_5_moe": tf.Qwen3_5MoeTextConfig}
    return classes[arch](**kwargs)


def _new_model(arch: str, cfg):
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    if arch == "qwen3_5_moe_vl":
        model = Qwen3_5MoeForConditionalGeneration(cfg).float()
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch in HYBRID_ARCHS:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "dt_bias")):
                    p.add_(torch.randn_like(p) * 0.3)
                elif name.endswith("A_log"):  # decay rates in [0.02, 0.3]: see the module
                    p.copy_(torch.empty_like(p).uniform_(0.02, 0.3).log())
    return model


def make_tiny_checkpoint(arch: str, out_dir: str | Path, *, seed: int = 0, sharded: bool = False,
                         dtype: torch.dtype = torch.float32, mtp_layers: int = 0,
                         **config_overrides: Any) -> Path:
    """Write a tiny random ``arch`` checkpoint (config.json + safetensors) into ``out_dir``.

    ``sharded=True`` splits the weights into many small files with a
    ``model.safetensors.index.json``. ``config_overrides`` go to the transformers config
    (e.g. ``tie_word_embeddings=True``, ``num_hidden_layers=3``, ``sliding_window=6``).
    ``dtype=torch.bfloat16`` saves the weights (and config ``torch_dtype``) in bf16, so an fp32
    and a bf16 run see the same weights. ``mtp_layers=n`` (hybrids) adds a random MTP head of
    n layers with the published ``mtp.*`` names (``mtp_ckpt.add_random_mtp_head``). Returns
    the folder.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **config_overrides)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = _new_model(arch, cfg)
    finally:
        torch.random.set_rng_state(rng_state)
    if dtype != torch.float32:
        model = model.to(dtype)
        model.config.torch_dtype = dtype
    max_shard = "40KB" if sharded else "2GB"
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard)
    if mtp_layers:
        from mtp_ckpt import add_random_mtp_head

        add_random_mtp_head(arch, out, mtp_layers, seed=seed)
    return out


#: The trained checkpoint's task: every token in [SUCC_LO, SUCC_HI) is followed by the next one
#: (the last by the first).
SUCC_LO, SUCC_HI = 3, 300


def make_trained_checkpoint(arch: str, out_dir: str | Path, *, steps: int = 300, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16,
                            **config_overrides: Any) -> Path:
    """A tiny ``arch`` checkpoint trained for ``steps`` Adam steps on CPU (seconds) to continue
    each token with its successor in ``[SUCC_LO, SUCC_HI)``, saved in ``dtype``.

    Random tiny models sit near ties everywhere (one bf16 rounding flips a greedy pick, and
    every later token with it); a trained model's picks mostly have wide margins. On this one a
    bf16 path and an fp32 path agree unless one of them computes something else. Deterministic
    for a given ``seed``. Returns the folder.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **{"initializer_range": 0.02, **config_overrides})
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        span = SUCC_HI - SUCC_LO
        for _ in range(steps):
            start = torch.randint(0, span, (64, 1))
            ids = SUCC_LO + (start + torch.arange(25)) % span  # [64, 25] successor chains
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.random.set_rng_state(rng_state)
    model.eval()
    if dtype != torch.float32:
        model = model.to(dtype)
        model.config.torch_dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    return out
