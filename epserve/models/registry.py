"""Architecture name (config.json ``architectures[0]``) -> model class, imported lazily.

Invariants: the keys are exactly ``config.SUPPORTED_ARCHITECTURES``; an unknown name raises
``CheckpointError`` listing the supported ones; importing this module imports no model file.
"""

from __future__ import annotations

import importlib

from torch import nn

from epserve.models.config import CheckpointError

_MODELS: dict[str, tuple[str, str]] = {
    "Qwen3MoeForCausalLM": ("epserve.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("epserve.models.mixtral", "MixtralForCausalLM"),
    "Qwen3NextForCausalLM": ("epserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("epserve.models.qwen3_next", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("epserve.models.qwen3_next",
                                           "Qwen3_5MoeForConditionalGeneration"),
}


def supported_architectures() -> tuple[str, ...]:
    """The architecture names ``get_model_class`` accepts."""
    return tuple(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for ``architecture``; ``CheckpointError`` when it is not supported."""
    entry = _MODELS.get(architecture)
    if entry is None:
        raise CheckpointError(f"architecture {architecture!r} is not supported; supported: "
                              f"{', '.join(_MODELS)}")
    module_name, class_name = entry
    return getattr(importlib.import_module(module_name), class_name)
