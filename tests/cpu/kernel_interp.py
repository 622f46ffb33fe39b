"""The Triton kernel modules in the interpreter, for the CPU op tests (one file per op).

triton.jit picks the interpreter when a kernel is *defined*, so a module imported while
``TRITON_INTERPRET=1`` runs its kernels on CPU tensors. ``interpreted_modules`` imports fresh
copies of ``epserve.kernels.triton.<name>`` that way (what they import of that package too),
then puts back what ``sys.modules`` and the package held before: other test modules, and a
later CUDA import, keep the compiled kind. ``use_interpreted`` (in a fixture) sets
``TRITON_INTERPRET=1`` and puts the copies in ``sys.modules`` for one test: the ops' entries
read it (``dispatch.use_triton``) and import their kernel lazily from there.

``kernel_fixtures`` makes a test file's two fixtures: ``interpret`` (the kernel tests, marked
``needs_triton``) and ``path``, which runs a test of an op's public entry once per path: the torch
reference, and the interpreted kernel (skipped where triton is not installed).
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest

from interp import import_interpreted

PKG = "epserve.kernels.triton"
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def interpreted_modules(*names: str) -> tuple[ModuleType, ...]:
    """Fresh interpreted copies of ``epserve.kernels.triton.<name>`` for each name (empty
    without triton); ``sys.modules`` and the package's attributes are as before afterwards."""
    if not HAS_TRITON:
        return tuple(None for _ in names)
    import epserve.kernels.triton as pkg

    saved = {n: m for n, m in sys.modules.items() if n.startswith(PKG + ".")}
    attrs = {n: getattr(pkg, n.rsplit(".", 1)[1], None) for n in saved}
    for n in saved:
        del sys.modules[n]
    try:
        mods = tuple(import_interpreted(f"{PKG}.{name}") for name in names)
    finally:
        for n in [n for n in sys.modules if n.startswith(PKG + ".")]:
            leaf = n.rsplit(".", 1)[1]
            del sys.modules[n]
            if getattr(pkg, leaf, None) is not None:
                delattr(pkg, leaf)
        sys.modules.update(saved)
        for n, attr in attrs.items():
            if attr is not None:
                setattr(pkg, n.rsplit(".", 1)[1], attr)
    return mods


def use_interpreted(monkeypatch: pytest.MonkeyPatch, names, mods) -> None:
    """For one test: ``TRITON_INTERPRET=1`` and ``mods`` as ``epserve.kernels.triton.<name>``."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name, mod in zip(names, mods):
        if mod is not None:  # None: no triton, so no entry imports a kernel
            monkeypatch.setitem(sys.modules, f"{PKG}.{name}", mod)


def kernel_fixtures(names, mods):
    """The fixtures ``interpret`` (this test runs the interpreted ``mods``) and ``path`` (this
    test runs once on the reference path, no interpreter, and once on the interpreted kernel)."""

    @pytest.fixture(name="interpret")
    def interpret(monkeypatch):
        use_interpreted(monkeypatch, names, mods)

    @pytest.fixture(name="path", params=["reference",
                                         pytest.param("interpreter", marks=needs_triton)])
    def path(request, monkeypatch):
        if request.param == "interpreter":
            use_interpreted(monkeypatch, names, mods)
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return request.param

    return interpret, path
