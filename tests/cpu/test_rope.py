"""Rotary position embedding and per-head q/k RMSNorm + rope: the references against a direct
complex rotation, and the Triton kernel (interpreter on CPU) against the refs, in place on q/k
given as strided views of one fused qkv projection. The same op with the paged KV write fused
in, and the kernel's tiling, are in test_rope_fused_kv.py.

Tolerances: fp32 atol/rtol 1e-5 (only the float32 sum-of-squares order differs from torch);
fp16 atol/rtol 2e-3 (at most one half-precision ulp from a differently rounded float32 value).
"""

from __future__ import annotations

import pytest
import torch
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

from epserve.kernels.rope import (apply_qk_norm_rope, apply_qk_norm_rope_ref, apply_rope,
                                  build_rope_cache)

_NAMES = ("rope", "kv_write")
_MODS = interpreted_modules(*_NAMES)
rt, _ = _MODS
assert rt is None or rt.INTERPRETED
interpret, _ = kernel_fixtures(_NAMES, _MODS)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def _close(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, **TOL[dtype])


# --------------------------------------------------------------------------- rope


def test_rope_matches_complex_rotation():
    d, theta = 16, 10000.0
    cos, sin = build_rope_cache(d, 64, theta)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 4, d, generator=g), torch.randn(5, 2, d, generator=g)
    pos = torch.tensor([0, 3, 17, 63, 1])
    q_rot, k_rot = apply_rope(q, k, pos, cos, sin)

    def direct(x):
        half = d // 2
        freqs = torch.tensor([theta ** (-2 * i / d) for i in range(half)], dtype=torch.float64)
        angle = pos.double()[:, None, None] * freqs  # [T, 1, D/2]
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.exp(1j * angle)
        return torch.cat([z.real, z.imag], dim=-1).float()

    torch.testing.assert_close(q_rot, direct(q), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_rot, direct(k), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q_rot[0], q[0])  # position 0 is the identity


def test_partial_rotary_rotates_the_first_dims_only():
    cos, sin = build_rope_cache(4, 64, 10000.0)  # R = 4 of D = 16, as Qwen3-Next's 0.25
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    pos = torch.tensor([0, 3, 17, 63, 1])
    q_rot, k_rot = apply_rope(q, k, pos, cos, sin)
    want_q, want_k = apply_rope(q[..., :4], k[..., :4], pos, cos, sin)  # a 4-dim head
    assert torch.equal(q_rot[..., :4], want_q) and torch.equal(k_rot[..., :4], want_k)
    assert torch.equal(q_rot[..., 4:], q[..., 4:]) and torch.equal(k_rot[..., 4:], k[..., 4:])
    with pytest.raises(ValueError, match="head_dim"):
        apply_rope(q[..., :2], k[..., :2], pos, cos, sin)  # more rotary dims than the head


@needs_triton
def test_partial_rotary_runs_the_kernel(interpret, monkeypatch):
    """Partial rotary takes the kernel (its cases: test_rope_partial.py), equal to the ref."""
    q, k, pos, _, _, qw, kw, _ = _qk_case(3, 4, 2, 16, torch.float32, seed=15)
    cos, sin = build_rope_cache(8, 64, 10000.0)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, kw)
    calls = []
    kernel = rt.qk_norm_rope_triton
    monkeypatch.setattr(rt, "qk_norm_rope_triton", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    apply_qk_norm_rope(q, k, pos, cos, sin, qw, kw)
    assert calls == [1]
    _close(q, ref_q, torch.float32)
    _close(k, ref_k, torch.float32)


# --------------------------------------------------------------------------- q/k norm + rope


def _qk_case(t, hq, hkv, d, dtype, seed, fused=True):
    """q, k as views of one fused [T, (Hq + 2 Hkv) * D] projection (strided), or standalone."""
    cos, sin = build_rope_cache(d, 64, 10000.0)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 64, (t,), generator=g)
    if fused:
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
        q = qkv[:, :hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        other = qkv[:, (hq + hkv) * d:]
    else:
        q = torch.randn(t, hq, d, generator=g).to(dtype)
        k = torch.randn(t, hkv, d, generator=g).to(dtype)
        other = None
    qw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    return q, k, positions, cos, sin, qw, kw, other


@needs_triton
@DTYPES
@pytest.mark.parametrize("fused", [True, False], ids=["qkv_views", "contiguous"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 16), (5, 6, 2, 32), (3, 2, 1, 24)],
                         ids=lambda s: "T{}Hq{}Hkv{}D{}".format(*s))
def test_qk_norm_rope_matches_ref(shape, fused, dtype, interpret):
    q, k, pos, cos, sin, qw, kw, other = _qk_case(*shape, dtype, seed=sum(shape), fused=fused)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, kw, 1e-6)
    other0 = None if other is None else other.clone()
    got_q, got_k = rt.qk_norm_rope_triton(q, k, pos, cos, sin, qw, kw, 1e-6)
    assert got_q is q and got_k is k  # in place
    _close(q, ref_q, dtype)
    _close(k, ref_k, dtype)
    if other is not None:
        assert torch.equal(other, other0)  # the v part of the fused buffer is untouched


@needs_triton
@DTYPES
def test_qk_rope_without_weights_is_plain_rope(dtype, interpret):
    q, k, pos, cos, sin, _, _, _ = _qk_case(4, 4, 2, 16, dtype, seed=11)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin)  # Mixtral: no q/k norm
    apply_qk_norm_rope(q, k, pos, cos, sin)  # public entry, in place
    _close(q, ref_q, dtype)
    _close(k, ref_k, dtype)


@needs_triton
def test_qk_norm_rope_one_weight_only_and_int32_positions(interpret):
    q, k, pos, cos, sin, qw, _, _ = _qk_case(3, 4, 2, 16, torch.float32, seed=12)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, None, 1e-5)
    rt.qk_norm_rope_triton(q, k, pos.int(), cos, sin, qw, None, 1e-5)
    _close(q, ref_q, torch.float32)
    _close(k, ref_k, torch.float32)


def test_qk_norm_rope_ref_path_is_in_place_too(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, pos, cos, sin, qw, kw, _ = _qk_case(2, 4, 2, 16, torch.float32, seed=13)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, kw)
    got_q, got_k = apply_qk_norm_rope(q, k, pos, cos, sin, qw, kw)
    assert got_q is q and got_k is k
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@needs_triton
def test_qk_norm_rope_errors(interpret):
    q, k, pos, cos, sin, qw, kw, _ = _qk_case(2, 4, 2, 16, torch.float32, seed=14, fused=False)
    with pytest.raises(ValueError, match="head_dim"):
        rt.qk_norm_rope_triton(q, k[..., :8], pos, cos, sin)
    with pytest.raises(ValueError, match="positions"):
        rt.qk_norm_rope_triton(q, k, pos[:1], cos, sin)
    with pytest.raises(ValueError, match="caches"):  # more rotary dims than the head
        rt.qk_norm_rope_triton(q, k, pos, torch.cat([cos, cos[:, :1]], 1),
                               torch.cat([sin, sin[:, :1]], 1))
    with pytest.raises(ValueError, match="caches"):
        rt.qk_norm_rope_triton(q, k, pos, cos[:, :4], sin[:, :3])
    with pytest.raises(ValueError, match="share one of"):
        rt.qk_norm_rope_triton(q, k.half(), pos, cos, sin)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rt.qk_norm_rope_triton(q.transpose(1, 2).contiguous().transpose(1, 2), k, pos, cos, sin)
    with pytest.raises(ValueError, match="broadcast"):
        rt.qk_norm_rope_triton(q, k[:, :1].expand(2, 2, 16), pos, cos, sin)
    with pytest.raises(ValueError, match="q_weight"):
        rt.qk_norm_rope_triton(q, k, pos, cos, sin, qw[:8], kw)
    with pytest.raises(ValueError, match="k_weight"):
        apply_qk_norm_rope(q, k, pos, cos, sin, qw, kw[:8])
