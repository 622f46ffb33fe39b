"""The model configuration we serve from, parsed from a Hugging Face config.json.

Invariants: a ``ModelConfig`` exists only for a supported architecture with the default rope
and SwiGLU experts; every unsupported or malformed field raises ``CheckpointError`` naming the
field and its value. Both transformers 4.x (``rope_theta`` at top level, ``num_experts`` for
Qwen3) and 5.x (``rope_parameters``, ``num_local_experts``, ``dtype``) layouts are accepted. A
multimodal checkpoint (``Qwen3_5MoeForConditionalGeneration``) is read from its
``text_config``: its language model is what we serve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


class CheckpointError(ValueError):
    """A checkpoint (config or weights) that this code cannot serve; the message says why."""


#: The token mixers a layer of ``layer_types`` may name.
LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only MoE model's shape and numerics (architecture-independent names).

    ``moe_intermediate_size`` is the per-expert FFN width I; ``intermediate_size`` the width of
    dense MLP layers (Qwen3 ``mlp_only_layers`` / ``decoder_sparse_step``). ``sliding_window``
    ``None`` means full attention. ``eos_token_ids`` may hold several ids.

    Gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE): ``layer_types`` names each layer's token
    mixer, ``"full_attention"`` or ``"linear_attention"`` (empty: every layer full attention);
    the ``linear_*`` fields shape the DeltaNet layers (key / value heads and head dims, conv
    kernel width); ``partial_rotary_factor`` < 1 rotates only the first ``rotary_dim`` dims of
    each attention head; ``shared_expert_intermediate_size`` > 0 adds a gated shared expert
    beside the routed ones.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int
    norm_topk_prob: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self) -> None:
        linear = (self.linear_num_key_heads, self.linear_num_value_heads,
                  self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel_dim)
        checks = [
            (self.num_heads > 0 and self.num_kv_heads > 0
             and self.num_heads % self.num_kv_heads == 0,
             f"num_heads={self.num_heads} must be a positive multiple of num_kv_heads={self.num_kv_heads}"),
            (self.num_experts == 0 or 0 < self.top_k <= self.num_experts,
             f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]"),
            (self.head_dim > 0 and self.head_dim % 2 == 0,
             f"head_dim={self.head_dim} must be positive and even"),
            (self.num_layers > 0, f"num_layers={self.num_layers} must be positive"),
            (self.decoder_sparse_step > 0,
             f"decoder_sparse_step={self.decoder_sparse_step} must be positive"),
            (not self.layer_types or len(self.layer_types) == self.num_layers,
             f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}"),
            (set(self.layer_types) <= set(LAYER_TYPES),
             f"layer_types={list(self.layer_types)} may hold only {list(LAYER_TYPES)}"),
            (2 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0,
             f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim="
             f"{self.rotary_dim} for head_dim={self.head_dim} (must be even and in [2, head_dim])"),
            ("linear_attention" not in self.layer_types
             or (min(linear) > 0 and self.linear_num_value_heads % self.linear_num_key_heads == 0),
             f"linear attention needs positive linear_* fields with linear_num_value_heads a "
             f"multiple of linear_num_key_heads, got {linear}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise CheckpointError(f"config: {msg}")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is a sparse MoE block (else a dense MLP), as Qwen3 decides."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def is_linear_attention(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s token mixer is a gated DeltaNet (else full attention)."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == "linear_attention"

    @property
    def rotary_dim(self) -> int:
        """The rotated dims of each attention head (the first ones), as transformers rounds."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Parse a Hugging Face config.json dict; ``CheckpointError`` on anything unsupported."""
        archs = d.get("architectures")
        if not archs or not isinstance(archs, list):
            raise CheckpointError(f"config.json: field 'architectures' must be a non-empty list, "
                                  f"got {archs!r}")
        arch = archs[0]
        parser = _PARSERS.get(arch)
        if parser is None:
            raise CheckpointError(f"config.json: architectures={arch!r} is not supported; supported: "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch in _MULTIMODAL:
            d = _text_config(d)
        if _get(d, "hidden_act", "silu") != "silu":
            raise CheckpointError(f"config.json: hidden_act={d['hidden_act']!r} is not supported "
                                  "(only 'silu')")
        return cls(architecture=arch, **_common_fields(d), **parser(d))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``path/config.json`` (or ``path`` itself when it is a file)."""
        p = Path(path)
        cfg_file = p if p.is_file() else p / "config.json"
        if not cfg_file.is_file():
            raise CheckpointError(f"no config.json at {cfg_file}")
        try:
            d = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read {cfg_file}: {e}") from e
        return cls.from_hf_dict(d)


# --------------------------------------------------------------------------- parsing

_REQUIRED = object()


def _get(d: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    value = d.get(key)
    if value is not None:
        return value
    if default is _REQUIRED:
        raise CheckpointError(f"config.json: required field {key!r} is missing")
    return default


def _first(d: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` present and not None (the field under its 4.x or 5.x name)."""
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    raise CheckpointError(f"config.json: required field {' or '.join(map(repr, keys))} is missing")


def _rope_theta(d: dict[str, Any], default_theta: float) -> float:
    """rope_theta from ``rope_parameters`` (transformers 5) or top level (4.x); default rope only."""
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", default_theta))
    if not isinstance(params, dict):
        raise CheckpointError(f"config.json: rope_parameters={params!r} is not a dict")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"config.json: rope_type={rope_type!r} is not supported (only 'default')")
    return float(params.get("rope_theta", d.get("rope_theta", default_theta)))


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _common_fields(d: dict[str, Any]) -> dict[str, Any]:
    hidden, heads = int(_get(d, "hidden_size")), int(_get(d, "num_attention_heads"))
    return dict(
        model_type=str(_get(d, "model_type", "")),
        vocab_size=int(_get(d, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(d, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_get(d, "num_key_value_heads", heads)),
        head_dim=int(_get(d, "head_dim", hidden // heads)),
        max_position_embeddings=int(_get(d, "max_position_embeddings")),
        num_experts=int(_first(d, "num_experts", "num_local_experts")),
        top_k=int(_get(d, "num_experts_per_tok")),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_ids(d.get("eos_token_id")),
        torch_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
    )


def _qwen3_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    if d.get("attention_bias"):
        raise CheckpointError("config.json: attention_bias=True is not supported for Qwen3-MoE")
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    return dict(
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(d, 10000.0),
        moe_intermediate_size=int(_get(d, "moe_intermediate_size")),
        intermediate_size=int(_get(d, "intermediate_size")),
        norm_topk_prob=bool(_get(d, "norm_topk_prob", False)),
        qk_norm=True,
        sliding_window=None if window is None else int(window),
        decoder_sparse_step=int(_get(d, "decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in _get(d, "mlp_only_layers", ())),
    )


def _mixtral_fields(d: dict[str, Any]) -> dict[str, Any]:
    window = d.get("sliding_window")
    return dict(
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-5)),
        rope_theta=_rope_theta(d, 1e6),
        moe_intermediate_size=int(_get(d, "intermediate_size")),
        intermediate_size=int(_get(d, "intermediate_size")),
        norm_topk_prob=True,
        qk_norm=False,
        sliding_window=None if window is None else int(window),
    )


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's ``text_config`` as a config of its own: its architecture, and the
    top level's ``tie_word_embeddings`` and dtype (which transformers reads there)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json: architectures={d['architectures'][0]!r} needs a "
                              f"'text_config' dict, got {text!r}")
    merged = {**text, "architectures": d["architectures"]}
    for key in ("tie_word_embeddings", "dtype", "torch_dtype"):
        if d.get(key) is not None:
            merged[key] = d[key]
    return merged


def _layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """``layer_types``, or (older configs) every ``full_attention_interval``-th layer full
    attention and the rest linear, as transformers fills it in."""
    types = d.get("layer_types")
    if types is None:
        interval = int(_get(d, "full_attention_interval", 4))
        if interval < 1:
            raise CheckpointError(f"config.json: full_attention_interval={interval} must be >= 1")
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(int(_get(d, "num_hidden_layers")))]
    return tuple(str(t) for t in types)


def _hybrid_fields(d: dict[str, Any]) -> dict[str, Any]:
    """What Qwen3-Next and Qwen3.5-MoE share: zero-centred norms, gated attention with q/k norm
    and partial rotary (``partial_rotary_factor`` in ``rope_parameters`` or, 4.x, at top level;
    0.25 when absent, as transformers defaults it), DeltaNet layers, a shared expert. Qwen3.5's
    multimodal rope (``mrope_section``) is plain rope on text-only positions."""
    if d.get("attention_bias"):
        raise CheckpointError(f"config.json: attention_bias=True is not supported for "
                              f"{d['architectures'][0]}")
    params = d.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    return dict(
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(d, 10000.0),
        partial_rotary_factor=float(factor),
        moe_intermediate_size=int(_get(d, "moe_intermediate_size")),
        shared_expert_intermediate_size=int(_get(d, "shared_expert_intermediate_size")),
        qk_norm=True,
        layer_types=_layer_types(d),
        linear_num_key_heads=int(_get(d, "linear_num_key_heads")),
        linear_num_value_heads=int(_get(d, "linear_num_value_heads")),
        linear_key_head_dim=int(_get(d, "linear_key_head_dim")),
        linear_value_head_dim=int(_get(d, "linear_value_head_dim")),
        linear_conv_kernel_dim=int(_get(d, "linear_conv_kernel_dim")),
    )


def _qwen3_next_fields(d: dict[str, Any]) -> dict[str, Any]:
    return dict(
        **_hybrid_fields(d),
        intermediate_size=int(_get(d, "intermediate_size")),
        norm_topk_prob=bool(_get(d, "norm_topk_prob", True)),
        decoder_sparse_step=int(_get(d, "decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in _get(d, "mlp_only_layers", ())),
    )


def _qwen3_5_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Every layer MoE, the top-k weights always renormalised."""
    return dict(**_hybrid_fields(d), intermediate_size=0, norm_topk_prob=True)


_PARSERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "Qwen3MoeForCausalLM": _qwen3_moe_fields,
    "MixtralForCausalLM": _mixtral_fields,
    "Qwen3NextForCausalLM": _qwen3_next_fields,
    "Qwen3_5MoeForCausalLM": _qwen3_5_moe_fields,
    "Qwen3_5MoeForConditionalGeneration": _qwen3_5_moe_fields,
}
#: Architectures whose config.json nests the language model's config in ``text_config``.
_MULTIMODAL = frozenset({"Qwen3_5MoeForConditionalGeneration"})

#: Architectures (config.json ``architectures[0]``) this package can serve.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_PARSERS)
