"""The gated-DeltaNet hybrids' norms: zero-centred RMSNorm (alone and after a residual add) and
the DeltaNet gated output norm. References against the dense formula (the public entries on
both paths: reference, interpreted Triton kernel), the kernels against the references.

Tolerances as test_norm.py (fp32 1e-5; fp16 one ulp: the kernel rounds at the same points,
only the float32 sum-of-squares order differs). bf16 only within a tolerance: the interpreter
casts float32 to bf16 by truncation, not to nearest as the GPU does (tests/gpu: bf16 exact
where the rounding points are the same). The zero-centred
kernels add the 1 to the weight in float32: a weight of a few thousandths (far below bf16's
2^-7 resolution near 1) must change the result exactly as the reference says.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

from epserve.kernels.norm import (fused_add_zero_centred_rms_norm,
                                  fused_add_zero_centred_rms_norm_ref, gated_rms_norm,
                                  gated_rms_norm_ref, rms_norm_ref, zero_centred_rms_norm,
                                  zero_centred_rms_norm_ref)
from epserve.models.layers import ZeroCentredRMSNorm

_NAMES = ("norm",)
_MODS = interpreted_modules(*_NAMES)
nt, = _MODS
assert nt is None or nt.INTERPRETED

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
interpret, path = kernel_fixtures(_NAMES, _MODS)
EPS = 1e-6


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _close(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, **TOL[dtype])


def _dense_zc(x, w):
    x, w = x.double(), w.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * (1 + w)


# --------------------------------------------------------------------------- the entries


def test_zero_centred_entries_match_the_formula(path):
    x, res = _rand(5, 48, seed=1), _rand(5, 48, seed=2)
    w = _rand(48, seed=3, scale=0.02)
    torch.testing.assert_close(zero_centred_rms_norm(x, w, EPS).double(), _dense_zc(x, w),
                               atol=1e-5, rtol=1e-5)
    normed, new_res = fused_add_zero_centred_rms_norm(x, res, w, EPS)
    assert torch.equal(new_res, x + res)
    torch.testing.assert_close(normed.double(), _dense_zc(x + res, w), atol=1e-5, rtol=1e-5)
    layer = ZeroCentredRMSNorm(48, EPS)  # the model's module: the same two calls
    with torch.no_grad():
        layer.weight.copy_(w)
        torch.testing.assert_close(layer(x), zero_centred_rms_norm(x, w, EPS))
        got, got_res = layer(x, res)
    assert torch.equal(got_res, new_res)
    torch.testing.assert_close(got, normed)


def test_gated_entry_matches_the_formula(path):
    proj = _rand(3, 4 * 24 + 7, seed=4)
    x = _rand(3, 4, 24, seed=5)
    z = proj[:, 7:].view(3, 4, 24)  # a gate sliced out of a projection: strided rows
    w = _rand(24, seed=6)
    xd = x.double()
    want = w.double() * xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + EPS) \
        * F.silu(z.double())
    torch.testing.assert_close(gated_rms_norm(x, z, w, EPS).double(), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the kernels


@needs_triton
@DTYPES
@pytest.mark.parametrize("shape", [(1, 32), (5, 48), (2, 3, 24), (4, 1)], ids=str)
def test_zero_centred_kernel_matches_ref(shape, dtype, interpret):
    x = _rand(*shape, dtype=dtype, seed=7) * 3
    w = _rand(shape[-1], dtype=dtype, seed=8, scale=0.02)  # stored around 0, as checkpoints do
    _close(nt.rms_norm_triton(x, w, EPS, zero_centred=True), zero_centred_rms_norm_ref(x, w, EPS),
           dtype)
    r = _rand(*shape, dtype=dtype, seed=9)
    normed, new_res = nt.fused_add_rms_norm_triton(x, r, w, EPS, zero_centred=True)
    ref_normed, ref_res = fused_add_zero_centred_rms_norm_ref(x, r, w, EPS)
    assert torch.equal(new_res, ref_res)  # one rounded add: exact
    _close(normed, ref_normed, dtype)
    got = fused_add_zero_centred_rms_norm(x, r, w, EPS)  # public entry
    _close(got[0], ref_normed, dtype)
    assert torch.equal(got[1], ref_res)
    _close(zero_centred_rms_norm(x, w, EPS), zero_centred_rms_norm_ref(x, w, EPS), dtype)


@needs_triton
def test_zero_centred_kernel_keeps_a_small_bf16_weight(interpret):
    """w = 0.003 in bf16: ``1 + w`` rounded to bf16 is exactly 1 (resolution 2^-7 near 1), so a
    kernel that folded the weight in bf16 would return the plain norm. The kernel adds in
    float32: an fp32 input's result shows the 0.3% the reference has."""
    x = _rand(4, 64, seed=10)
    w = torch.full((64,), 0.003, dtype=torch.bfloat16)
    assert torch.equal(1 + w, torch.ones_like(w))
    got = nt.rms_norm_triton(x, w, EPS, zero_centred=True)
    ref = zero_centred_rms_norm_ref(x, w, EPS)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    plain = rms_norm_ref(x, torch.ones(64), EPS)
    assert (got / plain - 1).abs().min() > 0.0029


@needs_triton
@DTYPES
@pytest.mark.parametrize("shape", [(1, 4, 16), (3, 2, 24), (5, 40), (2, 2, 2, 8)], ids=str)
def test_gated_kernel_matches_ref(shape, dtype, interpret):
    d = shape[-1]
    x = _rand(*shape, dtype=dtype, seed=11) * 2
    wide = _rand(*shape[:-1], d + 5, dtype=dtype, seed=12)
    z = wide[..., 5:]  # strided: the kernel reads the gate in place
    w = _rand(d, dtype=dtype, seed=13)
    _close(nt.gated_rms_norm_triton(x, z, w, EPS), gated_rms_norm_ref(x, z, w, EPS), dtype)
    _close(gated_rms_norm(x, z, w, EPS), gated_rms_norm_ref(x, z, w, EPS), dtype)  # entry
    wf = w.float()  # a float32 weight with a half-precision input: one product, one cast
    _close(nt.gated_rms_norm_triton(x, z, wf, EPS), gated_rms_norm_ref(x, z, wf, EPS), dtype)


@needs_triton
def test_gated_kernel_layer_layout_and_errors(interpret):
    """The DeltaNet layer's call: o [n, Hv, Dv] contiguous, z a [n, Hv, Dv] view of the
    projection (row stride its width); an fp32 gate for a bf16 x; bad arguments."""
    n, hv, dv = 3, 4, 12
    proj = _rand(n, 2 * hv * dv + 2 * hv, dtype=torch.bfloat16, seed=14)
    z = proj[:, hv * dv:2 * hv * dv].view(n, hv, dv)
    o = _rand(n, hv, dv, dtype=torch.bfloat16, seed=15)
    w = _rand(dv, dtype=torch.bfloat16, seed=16)
    _close(nt.gated_rms_norm_triton(o, z, w, EPS), gated_rms_norm_ref(o, z, w, EPS),
           torch.bfloat16)
    zf = z.float()
    _close(nt.gated_rms_norm_triton(o, zf, w, EPS), gated_rms_norm_ref(o, zf, w, EPS),
           torch.bfloat16)
    assert nt.gated_rms_norm_triton(o[:0], z[:0], w, EPS).shape == (0, hv, dv)
    with pytest.raises(ValueError, match="gate"):
        nt.gated_rms_norm_triton(o, z[:, :2], w, EPS)
    with pytest.raises(ValueError, match="weight"):
        nt.gated_rms_norm_triton(o, z, w[:5], EPS)
    x = o.double()  # the entry keeps the reference for what the kernel does not cover
    torch.testing.assert_close(gated_rms_norm(x, z.double(), w.double(), EPS),
                               gated_rms_norm_ref(x, z.double(), w.double(), EPS))
