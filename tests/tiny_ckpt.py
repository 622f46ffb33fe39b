"""Tiny random Hugging Face MoE checkpoints for tests, written with transformers' save_pretrained.

Invariants: nothing is downloaded; the same (arch, seed, overrides) gives the same weights; the
weights are scaled up (``initializer_range``) so logits are far from uniform and greedy picks
are not near-ties; ``eos_token_id`` is 2 and ``bos_token_id`` 1.
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


def tiny_config(arch: str, **overrides: Any):
    """The transformers config object of a tiny ``arch`` model (``qwen3_moe`` or ``mixtral``)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    classes = {"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}
    if arch not in classes:
        raise ValueError(f"tiny checkpoint arch must be one of {sorted(classes)}, got {arch!r}")
    kwargs = {**_COMMON, **_ARCH_DEFAULTS[arch], **overrides}
    return classes[arch](**kwargs)


def make_tiny_checkpoint(arch: str, out_dir: str | Path, *, seed: int = 0, sharded: bool = False,
                         dtype: torch.dtype = torch.float32, **config_overrides: Any) -> Path:
    """Write a tiny random ``arch`` checkpoint (config.json + safetensors) into ``out_dir``.

    ``sharded=True`` splits the weights into many small files with a
    ``model.safetensors.index.json``. ``config_overrides`` go to the transformers config
    (e.g. ``tie_word_embeddings=True``, ``num_hidden_layers=3``, ``sliding_window=6``).
    ``dtype=torch.bfloat16`` saves the weights (and config ``torch_dtype``) in bf16, so an fp32
    and a bf16 run see the same weights. Returns the folder.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **config_overrides)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(rng_state)
    if dtype != torch.float32:
        model = model.to(dtype)
        model.config.torch_dtype = dtype
    max_shard = "40KB" if sharded else "2GB"
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard)
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
