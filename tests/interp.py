"""Import a Triton kernel module in the interpreter for the CPU tests.

triton.jit picks the interpreter when a kernel is *defined*, so ``TRITON_INTERPRET=1`` is set
around the import and restored afterwards (other test modules keep the torch reference path);
each test module also sets it while its tests run (triton reads it again at launch).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def import_interpreted(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with TRITON_INTERPRET=1 during the import."""
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.import_module(name)
    finally:
        if prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = prev
