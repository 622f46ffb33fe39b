"""epserve: expert-parallel serving of Mixture-of-Experts language models on Ray.

The offline API is vLLM's shape: ``from epserve import LLM, SamplingParams``. Imports are lazy
so that ``import epserve`` (and the CLI's ``--help``) stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "EngineDead"]

if TYPE_CHECKING:  # pragma: no cover
    from epserve.cluster.llm import LLM
    from epserve.head.async_engine import EngineDead
    from epserve.head.outputs import CompletionOutput, RequestOutput
    from epserve.head.sampling_params import SamplingParams
    from epserve.head.structured_params import StructuredOutputsParams

_LAZY = {
    "LLM": "epserve.cluster.llm",
    "SamplingParams": "epserve.head.sampling_params",
    "StructuredOutputsParams": "epserve.head.structured_params",
    "RequestOutput": "epserve.head.outputs",
    "CompletionOutput": "epserve.head.outputs",
    "EngineDead": "epserve.head.async_engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'epserve' has no attribute {name!r}")
