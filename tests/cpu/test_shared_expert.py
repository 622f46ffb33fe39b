"""The hybrids' gated shared expert: ``shared_expert_ref`` against the formula, the two fused
launches (``shared_expert_triton``, interpreter on CPU) against the reference, and the entry
``shared_expert_add`` on both paths (the kernel for one row only). CUDA (bf16, the model's
shapes, a CUDA graph): tests/gpu/test_hybrid_kernels_gpu.py.

Bars: fp32 within 1e-5 (the float32 sums in another order); bf16 within bf16 rounding of the
output (the interpreter rounds float32 to bf16 by truncation, torch to nearest, at each of the
eager ops' rounding points).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

import epserve.kernels.shared_expert as se
from epserve.kernels.shared_expert import shared_expert_add, shared_expert_ref

_NAMES = ("shared_expert", "linear")
_MODS = interpreted_modules(*_NAMES)
sek, _ = _MODS
assert sek is None or sek.INTERPRETED
interpret, path = kernel_fixtures(_NAMES, _MODS)

FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


def _case(t, h, i, dtype=torch.float32, seed=0, wide=0):
    """x, routed [t, H] and the weights (rows of a wider tensor when ``wide``: strided rows)."""
    gen = torch.Generator().manual_seed(seed)

    def w(n, k):
        return (torch.randn(n, k + wide, generator=gen) * k ** -0.5)[:, :k].to(dtype)

    x = torch.randn(t, h, generator=gen).to(dtype)
    routed = torch.randn(t, h, generator=gen).to(dtype)
    return x, routed, w(2 * i, h), w(h, i), w(1, h)


def test_ref_is_the_formula():
    x, routed, w_gu, w_d, w_g = _case(3, 16, 8, torch.float64)
    g, u = x @ w_gu[:8].T, x @ w_gu[8:].T
    want = routed + 1 / (1 + torch.exp(-(x @ w_g.T))) * ((g * torch.sigmoid(g) * u) @ w_d.T)
    torch.testing.assert_close(shared_expert_ref(x, routed, w_gu, w_d, w_g), want)


@needs_triton
@pytest.mark.parametrize("h,i,wide", [(64, 32, 0), (48, 24, 0), (40, 12, 8), (16, 1, 0)],
                         ids=lambda v: str(v))
def test_kernel_matches_ref_fp32(h, i, wide, interpret, monkeypatch):
    x, routed, w_gu, w_d, w_g = _case(1, h, i, seed=h + i, wide=wide)
    got = sek.shared_expert_triton(x, routed, w_gu, w_d, w_g)
    monkeypatch.delenv("TRITON_INTERPRET")  # the reference on torch's own ops
    torch.testing.assert_close(got, shared_expert_ref(x, routed, w_gu, w_d, w_g), **FP32)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_matches_ref_half(dtype, interpret, monkeypatch):
    x, routed, w_gu, w_d, w_g = _case(1, 64, 48, dtype, seed=3)
    got = sek.shared_expert_triton(x, routed, w_gu, w_d, w_g)
    assert got.dtype == dtype
    monkeypatch.delenv("TRITON_INTERPRET")
    torch.testing.assert_close(got.float(), shared_expert_ref(x, routed, w_gu, w_d, w_g).float(),
                               **BF16)


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(1e3): inf, as on CUDA
def test_kernel_gate_saturates(interpret, monkeypatch):
    """A gate logit far out on either side: the shared expert fully in (sigmoid 1) or out (the
    routed output alone, exactly)."""
    x, routed, w_gu, w_d, w_g = _case(1, 32, 16, seed=4)
    for scale, exact in ((1e3, False), (-1e3, True)):
        w_g_far = x.sign() * scale  # x . w_g = scale * sum|x|: far from 0
        got = sek.shared_expert_triton(x, routed, w_gu, w_d, w_g_far)
        with monkeypatch.context() as m:
            m.delenv("TRITON_INTERPRET")
            want = shared_expert_ref(x, routed, w_gu, w_d, w_g_far)
        if exact:
            assert torch.equal(got, routed)
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("rows", [1, 3])
def test_entry_on_both_paths(path, rows, monkeypatch):
    """The block's call: equal to the reference; on the interpreted path one row takes the two
    fused launches, more rows the projections and two elementwise launches; no eager
    elementwise op either way."""
    x, routed, w_gu, w_d, w_g = _case(rows, 48, 16, seed=rows)
    with monkeypatch.context() as m:
        m.delenv("TRITON_INTERPRET", raising=False)
        want = shared_expert_ref(x, routed, w_gu, w_d, w_g)
    calls = []
    if path == "interpreter":
        for name in ("shared_expert_triton", "swiglu_triton", "gate_add_triton"):
            monkeypatch.setattr(sek, name, lambda *a, _r=getattr(sek, name), _n=name:
                                calls.append(_n) or _r(*a))
        monkeypatch.setattr(se, "shared_expert_ref", lambda *a: pytest.fail("unfused"))
        monkeypatch.setattr(F, "silu", lambda *a: pytest.fail("silu in torch"))
    got = shared_expert_add(x, routed, w_gu, w_d, w_g)
    torch.testing.assert_close(got, want, **FP32)
    fused = ["shared_expert_triton"] if rows == 1 else ["swiglu_triton", "gate_add_triton"]
    assert calls == (fused if path == "interpreter" else [])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_elementwise_kernels_match_the_eager_ops(dtype, interpret):
    """More rows: the SwiGLU and the gate + add each one launch, rounded as the eager ops
    (bf16: the interpreter's truncation against torch's rounding, one ulp)."""
    gen = torch.Generator().manual_seed(7)
    gate_up = torch.randn(5, 2 * 24, generator=gen).to(dtype)
    y, routed = (torch.randn(5, 40, generator=gen).to(dtype) for _ in range(2))
    logit = (torch.randn(5, 3, generator=gen) * 4).to(dtype)[:, 1:2]  # a column of a wider one
    tol = FP32 if dtype == torch.float32 else BF16
    want = F.silu(gate_up[:, :24]) * gate_up[:, 24:]
    torch.testing.assert_close(sek.swiglu_triton(gate_up), want, **tol)
    torch.testing.assert_close(sek.gate_add_triton(y, logit, routed),
                               routed + torch.sigmoid(logit) * y, **tol)
    with pytest.raises(ValueError, match=r"\[T, 1\]"):
        sek.gate_add_triton(y, torch.zeros(5, 2, dtype=dtype), routed)


def test_entry_errors():
    x, routed, w_gu, w_d, w_g = _case(1, 16, 8)
    with pytest.raises(ValueError, match="routed"):
        shared_expert_add(x, routed[:, :8], w_gu, w_d, w_g)
    with pytest.raises(ValueError, match="w_gate_up"):
        shared_expert_add(x, routed, w_gu[:15], w_d, w_g)
    with pytest.raises(ValueError, match="w_gate_up"):
        shared_expert_add(x, routed, w_gu, w_d, torch.cat([w_g, w_g]))


@needs_triton
def test_kernel_errors(interpret):
    x, routed, w_gu, w_d, w_g = _case(2, 16, 8)
    with pytest.raises(ValueError, match=r"\[1, H\]"):
        sek.shared_expert_triton(x, routed, w_gu, w_d, w_g)
    x, routed = x[:1], routed[:1]
    with pytest.raises(ValueError, match="dtypes"):
        sek.shared_expert_triton(x, routed, w_gu.double(), w_d, w_g)
    with pytest.raises(ValueError, match="contiguous"):
        sek.shared_expert_triton(x, routed, w_gu, w_d.T.contiguous().T, w_g)
