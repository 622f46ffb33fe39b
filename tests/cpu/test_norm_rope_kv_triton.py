"""RMSNorm, q/k-norm + rope and KV-write Triton kernels (Triton interpreter on CPU) vs the refs.

Tolerances: fp32 atol/rtol 1e-5 (only the float32 sum-of-squares order differs from torch);
fp16 atol/rtol 2e-3 (at most one half-precision ulp from a differently rounded float32 value);
KV writes are copies and must be exact (except fp32 -> bf16 caches: the interpreter truncates
where the GPU rounds to nearest even, so one bf16 ulp there). TRITON_INTERPRET=1 is set while the kernel modules are
imported (triton.jit picks the interpreter at decoration time) and, through an autouse fixture,
while each test here runs (the public entries dispatch on it); on teardown the interpreted
modules leave sys.modules, so a later CUDA test in the same session compiles them for real.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

_MODULES = ("epserve.kernels.norm_triton", "epserve.kernels.rope_triton",
            "epserve.kernels.kv_write_triton")
_prev = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    for _m in _MODULES:
        sys.modules.pop(_m, None)
    # By name, not ``from epserve.kernels import ...``: that returns a stale package attribute.
    nt, rt, kvt = (importlib.import_module(_m) for _m in _MODULES)
finally:
    if _prev is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _prev

import torch  # noqa: E402

from epserve.kernels.kv_write import write_kv, write_kv_ref  # noqa: E402
from epserve.kernels.norm import (fused_add_rms_norm, fused_add_rms_norm_ref,  # noqa: E402
                                  rms_norm, rms_norm_ref)
from epserve.kernels.rope import (apply_qk_norm_rope, apply_qk_norm_rope_ref,  # noqa: E402
                                  build_rope_cache)

assert nt._INTERPRETED and rt._INTERPRETED and kvt._INTERPRETED

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


@pytest.fixture(autouse=True, scope="module")
def _interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
    import epserve.kernels as pkg

    for m in _MODULES:
        sys.modules.pop(m, None)
        if getattr(pkg, m.rsplit(".", 1)[1], None) is not None:
            delattr(pkg, m.rsplit(".", 1)[1])


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _close(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, **TOL[dtype])


# --------------------------------------------------------------------------- rms norm


@DTYPES
@pytest.mark.parametrize("shape", [(1, 32), (5, 48), (2, 3, 24), (4, 1)], ids=str)
def test_rms_norm_matches_ref(shape, dtype):
    x = _rand(*shape, dtype=dtype, seed=1) * 3
    w = _rand(shape[-1], seed=2)  # float32 weight, as loaded checkpoints may keep it
    _close(nt.rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)
    w16 = w.to(dtype)
    _close(rms_norm(x, w16, 1e-5), rms_norm_ref(x, w16, 1e-5), dtype)  # public entry


@DTYPES
@pytest.mark.parametrize("shape", [(1, 32), (7, 40), (2, 3, 16)], ids=str)
def test_fused_add_rms_norm_matches_ref(shape, dtype):
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


def test_rms_norm_strided_rows():
    base = _rand(6, 64, seed=6)
    x = base[::2, 8:40]  # row stride 128, last dim contiguous
    w = _rand(32, seed=7)
    _close(nt.rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), torch.float32)
    xt = _rand(32, 5, seed=8).t()  # last dim not contiguous: copied to rows
    _close(nt.rms_norm_triton(xt, w, 1e-6), rms_norm_ref(xt, w, 1e-6), torch.float32)


def test_rms_norm_empty_and_errors():
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


@DTYPES
@pytest.mark.parametrize("fused", [True, False], ids=["qkv_views", "contiguous"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 16), (5, 6, 2, 32), (3, 2, 1, 24)],
                         ids=lambda s: "T{}Hq{}Hkv{}D{}".format(*s))
def test_qk_norm_rope_matches_ref(shape, fused, dtype):
    q, k, pos, cos, sin, qw, kw, other = _qk_case(*shape, dtype, seed=sum(shape), fused=fused)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, kw, 1e-6)
    other0 = None if other is None else other.clone()
    got_q, got_k = rt.qk_norm_rope_triton(q, k, pos, cos, sin, qw, kw, 1e-6)
    assert got_q is q and got_k is k  # in place
    _close(q, ref_q, dtype)
    _close(k, ref_k, dtype)
    if other is not None:
        assert torch.equal(other, other0)  # the v part of the fused buffer is untouched


@DTYPES
def test_qk_rope_without_weights_is_plain_rope(dtype):
    q, k, pos, cos, sin, _, _, _ = _qk_case(4, 4, 2, 16, dtype, seed=11)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin)  # Mixtral: no q/k norm
    apply_qk_norm_rope(q, k, pos, cos, sin)  # public entry, in place
    _close(q, ref_q, dtype)
    _close(k, ref_k, dtype)


def test_qk_norm_rope_one_weight_only_and_int32_positions():
    q, k, pos, cos, sin, qw, _, _ = _qk_case(3, 4, 2, 16, torch.float32, seed=12)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, None, 1e-5)
    rt.qk_norm_rope_triton(q, k, pos.int(), cos, sin, qw, None, 1e-5)
    _close(q, ref_q, torch.float32)
    _close(k, ref_k, torch.float32)


def test_qk_norm_rope_ref_path_is_in_place_too(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, pos, cos, sin, qw, kw, _ = _qk_case(2, 4, 2, 16, torch.float32, seed=13)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, kw)
    got_q, got_k = apply_qk_norm_rope(q, k, pos, cos, sin, qw, kw)
    assert got_q is q and got_k is k
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


def test_qk_norm_rope_errors():
    q, k, pos, cos, sin, qw, kw, _ = _qk_case(2, 4, 2, 16, torch.float32, seed=14, fused=False)
    with pytest.raises(ValueError, match="head_dim"):
        rt.qk_norm_rope_triton(q, k[..., :8], pos, cos, sin)
    with pytest.raises(ValueError, match="positions"):
        rt.qk_norm_rope_triton(q, k, pos[:1], cos, sin)
    with pytest.raises(ValueError, match="caches"):
        rt.qk_norm_rope_triton(q, k, pos, cos[:, :4], sin[:, :4])
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


# --------------------------------------------------------------------------- kv write


def _kv_case(t, hkv, d, nb, bs, dtype, cache_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(t, 3 * hkv * d, generator=g).to(dtype)  # k, v as strided views
    k = kv[:, hkv * d:2 * hkv * d].view(t, hkv, d)
    v = kv[:, 2 * hkv * d:].view(t, hkv, d)
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    return k, v, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.float16, torch.float16),
                                               (torch.float32, torch.float16),
                                               (torch.float32, torch.bfloat16)],
                         ids=["fp32", "fp16", "fp32->fp16", "fp32->bf16"])
@pytest.mark.parametrize("shape", [(1, 2, 16), (6, 3, 24), (5, 1, 8)],
                         ids=lambda s: "T{}Hkv{}D{}".format(*s))
def test_write_kv_matches_ref(shape, dtype, cache_dtype):
    t, hkv, d = shape
    k, v, kc, vc, slots = _kv_case(t, hkv, d, 4, 4, dtype, cache_dtype, seed=t + d)
    slots[t // 2] = -1  # a padded row
    ref_kc, ref_vc = kc.clone(), vc.clone()
    write_kv_ref(k, v, ref_kc, ref_vc, slots)
    kvt.write_kv_triton(k, v, kc, vc, slots)
    if cache_dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even): one bf16 ulp.
        torch.testing.assert_close(kc, ref_kc, rtol=1e-2, atol=1e-6)
        torch.testing.assert_close(vc, ref_vc, rtol=1e-2, atol=1e-6)
        untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool)
        untouched[slots[slots >= 0]] = False
        assert torch.equal(kc.view(-1, hkv, d)[untouched], ref_kc.view(-1, hkv, d)[untouched])
    else:
        assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


def test_write_kv_padding_rows_untouched_public_entry():
    k, v, kc, vc, slots = _kv_case(4, 2, 8, 3, 4, torch.float32, torch.float32, seed=21)
    slots = torch.tensor([5, -1, 0, -1])
    kc0, vc0 = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, slots.int())
    flat_k, flat_v = kc.view(12, 2, 8), vc.view(12, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_v[0], v[2])
    untouched = [s for s in range(12) if s not in (5, 0)]
    assert torch.equal(flat_k[untouched], kc0.view(12, 2, 8)[untouched])
    assert torch.equal(flat_v[untouched], vc0.view(12, 2, 8)[untouched])
    all_pad = torch.full((4,), -1)
    write_kv(k, v, kc, vc, all_pad)
    assert torch.equal(kc.view(12, 2, 8)[untouched], kc0.view(12, 2, 8)[untouched])


def test_write_kv_errors():
    k, v, kc, vc, slots = _kv_case(2, 2, 8, 2, 4, torch.float32, torch.float32, seed=22)
    with pytest.raises(ValueError, match="must both be"):
        kvt.write_kv_triton(k, v[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match="caches"):
        kvt.write_kv_triton(k, v, kc[:, :, :1], vc[:, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kvt.write_kv_triton(k, v, kc, vc, slots.float())
    with pytest.raises(ValueError, match="dtypes"):
        kvt.write_kv_triton(k, v, kc.double(), vc.double(), slots)
    with pytest.raises(ValueError, match="contiguous last dim"):
        kvt.write_kv_triton(k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, vc, slots)
    kvt.write_kv_triton(k[:0], v[:0], kc, vc, slots[:0])  # empty: no launch, no error
