"""RMSNorm and fused residual-add + RMSNorm: the references against the dense formula (the
public entries on both paths), and the Triton kernel (interpreter on CPU) against the refs. The
hybrids' zero-centred and gated norms: test_norm_hybrid.py.

Tolerances: fp32 atol/rtol 1e-5 (only the float32 sum-of-squares order differs from torch);
fp16 atol/rtol 2e-3 (at most one half-precision ulp from a differently rounded float32 value).
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

from epserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

_NAMES = ("norm",)
_MODS = interpreted_modules(*_NAMES)
nt, = _MODS
assert nt is None or nt.INTERPRETED

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
interpret, path = kernel_fixtures(_NAMES, _MODS)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _close(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, **TOL[dtype])


# --------------------------------------------------------------------------- the references


def test_rms_norm_and_fused_add(path):
    g = torch.Generator().manual_seed(3)
    x, res, w = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g), torch.randn(32, generator=g)
    ref = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref, atol=1e-5, rtol=1e-5)
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, rms_norm(x + res, w, 1e-6))
    assert rms_norm(x.bfloat16(), w.bfloat16(), 1e-6).dtype == torch.bfloat16
    assert math.isfinite(float(rms_norm(torch.zeros(1, 32), w, 1e-6).sum()))


# --------------------------------------------------------------------------- the Triton kernel


@needs_triton
@DTYPES
@pytest.mark.parametrize("shape", [(1, 32), (5, 48), (2, 3, 24), (4, 1)], ids=str)
def test_rms_norm_matches_ref(shape, dtype, interpret):
    x = _rand(*shape, dtype=dtype, seed=1) * 3
    w = _rand(shape[-1], seed=2)  # float32 weight, as loaded checkpoints may keep it
    _close(nt.rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)
    w16 = w.to(dtype)
    _close(rms_norm(x, w16, 1e-5), rms_norm_ref(x, w16, 1e-5), dtype)  # public entry


@needs_triton
@DTYPES
@pytest.mark.parametrize("shape", [(1, 32), (7, 40), (2, 3, 16)], ids=str)
def test_fused_add_rms_norm_matches_ref(shape, dtype, interpret):
    x, r = _rand(*shape, dtype=dtype, seed=3), _rand(*shape, dtype=dtype, seed=4)
    w = _rand(shape[-1], dtype=dtype, seed=5)
    x0, r0 = x.clone(), r.clone()
    normed, new_res = nt.fused_add_rms_norm_triton(x, r, w, 1e-6)
    ref_normed, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(new_res, ref_res)  # one rounded add: exact
    _close(normed, ref_normed, dtype)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    got = fused_add_rms_norm(x, r, w, 1e-6)  # public entry
    _close(got[0], ref_normed, dtype)


@needs_triton
def test_rms_norm_strided_rows(interpret):
    base = _rand(6, 64, seed=6)
    x = base[::2, 8:40]  # row stride 128, last dim contiguous
    w = _rand(32, seed=7)
    _close(nt.rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), torch.float32)
    xt = _rand(32, 5, seed=8).t()  # last dim not contiguous: copied to rows
    _close(nt.rms_norm_triton(xt, w, 1e-6), rms_norm_ref(xt, w, 1e-6), torch.float32)


@needs_triton
def test_rms_norm_empty_and_errors(interpret):
    w = torch.ones(16)
    assert nt.rms_norm_triton(torch.empty(0, 16), w, 1e-6).shape == (0, 16)
    with pytest.raises(ValueError, match="weight"):
        nt.rms_norm_triton(torch.randn(2, 16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="hidden size"):
        nt.rms_norm_triton(torch.randn(1, 8200), torch.ones(8200), 1e-6)
    with pytest.raises(ValueError, match="must be in"):
        nt.rms_norm_triton(torch.randn(2, 16).double(), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        nt.fused_add_rms_norm_triton(torch.randn(2, 16), torch.randn(2, 16).half(), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        nt.fused_add_rms_norm_triton(torch.randn(2, 16), torch.randn(3, 16), w, 1e-6)
    # The public entry keeps the reference for what the kernel does not cover.
    x = torch.randn(2, 16).double()
    torch.testing.assert_close(rms_norm(x, w.double(), 1e-6), rms_norm_ref(x, w.double(), 1e-6))
