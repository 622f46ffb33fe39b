"""The GPU tests' session: transformers, the fp32 CPU oracle, keeps to its torch path.

With fla-core installed (the hybrids' prefill kernels need it), transformers up to at least
5.17 (the GPU machine's) routes its gated-DeltaNet functions to fla's Triton kernels whatever
the inputs' device, so the oracle's CPU forward fails ("cannot be accessed from Triton (cpu
tensor?)"); 5.25 falls back to torch for CPU inputs itself. Its modeling modules call those
functions by their global names, so the undecorated torch functions go back in their place.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect


def _oracle_on_its_torch_path() -> None:
    if importlib.util.find_spec("fla") is None:
        return
    for arch in ("qwen3_next", "qwen3_5_moe"):
        try:
            mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
        except ImportError:
            continue
        for name, fn in list(vars(mod).items()):
            if name.startswith("torch_") and callable(fn) and hasattr(fn, "__wrapped__"):
                setattr(mod, name, inspect.unwrap(fn))


_oracle_on_its_torch_path()
