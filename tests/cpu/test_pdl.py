"""Programmatic dependent launch (``epserve/kernels/triton/pdl.py``): what makes it safe.

A kernel launched with PDL may start while the kernel before it still runs, so each kernel must
wait (``gdc_wait``) before its first load or store, and every launch must say whether PDL is
on. Read from the kernels' source: every ``triton.jit`` kernel (a ``_*_kernel``) takes
``PDL``, opens with the guarded wait (after its docstring, before anything else), and each of
its launches passes ``pdl(<that kernel>)``; and ``pdl`` is off for interpreted kernels (the
interpreter has no grid-dependency control) and on CPU-only machines.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import epserve.kernels

TRITON_DIR = Path(epserve.kernels.__file__).parent / "triton"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kernels() -> list[tuple[Path, ast.FunctionDef]]:
    out = []
    for path in sorted(TRITON_DIR.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "triton.jit" in ast.unparse(d) for d in node.decorator_list):
                out.append((path, node))
    return out


KERNELS = _kernels()


def test_the_kernels_are_found():
    names = {k.name for _, k in KERNELS}
    assert {"_gemv_kernel", "_moe_gemm_kernel", "_gated_delta_decode_kernel",
            "_rope_decode_kernel", "_gumbel_argmax_kernel"} <= names
    assert len(KERNELS) >= 20


@pytest.mark.parametrize("path,kernel", KERNELS, ids=[k.name for _, k in KERNELS])
def test_every_kernel_waits_before_anything_else(path, kernel):
    args = [a.arg for a in kernel.args.args]
    assert "PDL" in args, f"{path.name}:{kernel.name} takes no PDL"
    body = kernel.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = body[0]
    assert isinstance(first, ast.If) and ast.unparse(first.test) == "PDL", \
        f"{path.name}:{kernel.name} does not open with `if PDL:`"
    calls = [ast.unparse(s) for s in first.body]
    assert calls == ["tl.extra.cuda.gdc_wait()", "tl.extra.cuda.gdc_launch_dependents()"]


@pytest.mark.parametrize("path,kernel", KERNELS, ids=[k.name for _, k in KERNELS])
def test_every_launch_passes_pdl(path, kernel):
    tree = ast.parse(path.read_text())
    launches = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Subscript)
                and ast.unparse(n.func.value) == kernel.name]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and ast.unparse(n.func) == kernel.name]  # inlined into another kernel
    assert launches or calls, f"{kernel.name} is never launched in {path.name}"
    for n in launches:
        spread = [ast.unparse(k.value) for k in n.keywords if k.arg is None]
        assert f"pdl({kernel.name})" in spread, f"a launch of {kernel.name} without pdl()"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_pdl_is_off_for_interpreted_kernels_and_without_cuda(monkeypatch):
    from kernel_interp import interpreted_modules

    (lin,) = interpreted_modules("linear")
    from epserve.kernels.triton import pdl as pdl_mod

    assert pdl_mod.pdl(lin._gemv_kernel) == {"PDL": False, "launch_pdl": False}
    pdl_mod.pdl_device.cache_clear()
    monkeypatch.setenv("EPSERVE_PDL", "0")
    assert pdl_mod.pdl_device() is False
    pdl_mod.pdl_device.cache_clear()
    monkeypatch.delenv("EPSERVE_PDL")
    import torch

    assert pdl_mod.pdl_device() is (torch.cuda.is_available()
                                    and torch.cuda.get_device_capability()[0] >= 9)
    pdl_mod.pdl_device.cache_clear()
