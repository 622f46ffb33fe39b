"""A DeltaNet layer's g and beta from its projections: ``delta_gates_ref`` (the definition,
against the formula), the decode kernel computing them in its programs
(``gated_delta_decode_gates_triton``, interpreter on CPU) against ``delta_gates_ref`` then the
plain kernel and ``recurrent_ref``, and the entry ``gated_delta_step_gates`` on both paths
(reference, interpreted kernel) for decode and prefill steps.

a and b are strided columns of a projection as the layer has them; a + dt_bias spans softplus'
threshold (20) and its tiny tail. fp32 within the decode tests' tolerances (float32 in another
order); bf16 within a bf16 ulp of beta (the interpreter rounds float32 to bf16 by truncation,
the reference to nearest; tests/gpu compares bf16 on the GPU's rounding).
"""

from __future__ import annotations

import pytest
import torch
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

import epserve.kernels.gated_delta as gd
from epserve.kernels.gated_delta import (delta_gates_ref, gated_delta_step,
                                         gated_delta_step_gates, recurrent_ref)

_NAMES = ("gated_delta_decode",)
_MODS = interpreted_modules(*_NAMES)
gdd, = _MODS
assert gdd is None or gdd.INTERPRETED
interpret, path = kernel_fixtures(_NAMES, _MODS)

SPARE = 0
FP32 = dict(atol=2e-5, rtol=1e-4)
BF16 = dict(atol=2e-2, rtol=2e-2)


def _case(s, hk, hv, dk, dv, dtype, seed, n_slots=9, param_dtype=torch.float32):
    """q, k, v, a, b: views of one projection row (a, b strided [S, Hv]); A_log, dt_bias [Hv];
    a pool of random states, shuffled slots, two fresh sequences and a padded row at SPARE."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * hk * dk + hv * dv + 2 * hv + 3
    proj = torch.randn(s, width, generator=gen).to(dtype)
    c = 2 * hk * dk + hv * dv
    q = proj[:, :hk * dk].view(s, hk, dk)
    k = proj[:, hk * dk:2 * hk * dk].view(s, hk, dk)
    v = proj[:, 2 * hk * dk:c].view(s, hv, dv)
    b, a = proj[:, c:c + hv], proj[:, c + hv:c + 2 * hv]
    with torch.no_grad():  # a + dt_bias over softplus' threshold and far below 0, too
        a[0, 0] = 30.0
        a[-1, -1] = -40.0
    A_log = (torch.rand(hv, generator=gen) * 2 - 1).to(param_dtype)
    dt_bias = (torch.rand(hv, generator=gen) * 2 - 1).to(param_dtype)
    pool = torch.randn(n_slots, hv, dk, dv, generator=gen) * 0.3
    slots = torch.randperm(n_slots - 1, generator=gen)[:s] + 1
    slots[-1] = SPARE
    fresh = torch.zeros(s, dtype=torch.bool)
    fresh[[i for i in (1, 3) if i < s]] = True
    fresh[-1] = True
    return (q, k, v), (a, b, A_log, dt_bias), pool, slots, fresh


def _want(qkv, gates, pool, slots, fresh):
    g, beta = delta_gates_ref(*gates)
    o, new = recurrent_ref(*qkv, g, beta, pool[slots].masked_fill(fresh[:, None, None, None], 0),
                           list(range(len(slots) + 1)))
    want = pool.clone()
    want[slots] = new
    return o, want


def _check(o, want_o, pool, want_pool, tol):
    torch.testing.assert_close(o, want_o, **tol)
    keep = torch.ones(pool.shape[0], dtype=torch.bool)
    keep[SPARE] = False
    torch.testing.assert_close(pool[keep], want_pool[keep], **tol)


def test_delta_gates_ref_is_the_formula():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(5, 4, generator=gen) * 10, torch.randn(5, 4, generator=gen)
    A_log, dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    g, beta = delta_gates_ref(a, b, A_log, dt_bias)
    x = a.double() + dt_bias.double()
    torch.testing.assert_close(g.double(), -A_log.double().exp() * torch.log1p(x.exp()),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta, 1 / (1 + (-b).exp()))
    assert g.dtype == torch.float32 and (g <= 0).all()
    gb, betab = delta_gates_ref(a.bfloat16(), b.bfloat16(), A_log, dt_bias.bfloat16())
    assert gb.dtype == torch.float32 and betab.dtype == torch.bfloat16  # as the layer had them


@needs_triton
@pytest.mark.parametrize("dtype,params", [(torch.float32, torch.float32),
                                          (torch.bfloat16, torch.float32),
                                          (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16", "bf16_params"])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 16), (1, 3, 12, 20), (2, 4, 32, 8)],
                         ids=lambda v: str(v))
def test_gates_kernel_matches_ref(hk, hv, dk, dv, dtype, params, interpret):
    s = 5
    qkv, gates, pool, slots, fresh = _case(s, hk, hv, dk, dv, dtype, seed=hv * dk + dv,
                                           param_dtype=params)
    want_o, want_pool = _want(qkv, gates, pool, slots, fresh)
    plain_pool = pool.clone()
    plain_o = gdd.gated_delta_decode_triton(*qkv, *delta_gates_ref(*gates), plain_pool, slots,
                                            fresh)
    o = gdd.gated_delta_decode_gates_triton(*qkv, *gates, pool, slots, fresh)
    assert o.dtype == dtype
    tol = FP32 if dtype == torch.float32 else BF16
    _check(o, want_o, pool, want_pool, tol)
    _check(o, plain_o, pool, plain_pool, tol)  # the same launch given g and beta


@needs_triton
@pytest.mark.parametrize("x", [25.0, 21.0, 3.0, -12.0, -30.0])
def test_gates_kernel_softplus_tails(x, interpret):
    """a + dt_bias on either side of softplus' threshold (20: x itself) and deep in its tail
    (exp(x)), with a state that is read (not fresh), so the decay shows."""
    qkv, (a, b, A_log, dt_bias), pool, slots, fresh = _case(2, 1, 1, 8, 8, torch.float32, 5)
    a.fill_(x)
    dt_bias.zero_()
    fresh.fill_(False)
    want_o, want_pool = _want(qkv, (a, b, A_log, dt_bias), pool, slots, fresh)
    o = gdd.gated_delta_decode_gates_triton(*qkv, a, b, A_log, dt_bias, pool, slots, fresh)
    _check(o, want_o, pool, want_pool, dict(atol=1e-6, rtol=1e-6))


@pytest.mark.parametrize("decode,hold", [(True, ()), (False, ()), (False, (1,))],
                         ids=["decode", "short", "short-held"])
def test_step_gates_entry_on_both_paths(path, decode, hold, monkeypatch):
    """The layer's call: equal to ``delta_gates_ref`` then ``gated_delta_step``; on the
    interpreted kernels (decode, and varlen for a short step such as a verify with its
    sequences held) nothing computes g and beta outside them."""
    s = 4
    qkv, gates, pool, slots, fresh = _case(s, 2, 4, 8, 6, torch.float32, seed=9)
    cu = tuple(range(s + 1))
    if not decode:  # two sequences of two tokens each
        slots, fresh, cu = slots[:2], fresh[:2], (0, 2, 4)
    want_pool = pool.clone()
    want_o = gated_delta_step(*qkv, *delta_gates_ref(*gates), want_pool, slots, fresh, cu, decode,
                              hold)
    if path == "interpreter":
        monkeypatch.setattr(gd, "delta_gates_ref", lambda *a: pytest.fail("gates in torch"))
    o = gated_delta_step_gates(*qkv, *gates, pool, slots, fresh, cu, decode, hold)
    _check(o, want_o, pool, want_pool, FP32)


def test_step_gates_errors():
    qkv, (a, b, A_log, dt_bias), pool, slots, fresh = _case(3, 1, 2, 8, 4, torch.float32, 3)
    cu = (0, 1, 2, 3)
    with pytest.raises(ValueError, match="A_log"):
        gated_delta_step_gates(*qkv, a[:, :1], b, A_log, dt_bias, pool, slots, fresh, cu, True)
    with pytest.raises(ValueError, match="A_log"):
        gated_delta_step_gates(*qkv, a, b, A_log[:1], dt_bias, pool, slots, fresh, cu, True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_step_gates(*qkv, a, b, A_log, dt_bias, pool, slots, fresh, (0, 3), False)


@needs_triton
def test_gates_kernel_errors(interpret):
    qkv, (a, b, A_log, dt_bias), pool, slots, fresh = _case(3, 1, 2, 8, 4, torch.float32, 3)
    with pytest.raises(ValueError, match="A_log and dt_bias"):
        gdd.gated_delta_decode_gates_triton(*qkv, a, b, A_log[:1], dt_bias, pool, slots, fresh)
    with pytest.raises(ValueError, match="must be"):
        gdd.gated_delta_decode_gates_triton(*qkv, a[:, :1], b, A_log, dt_bias, pool, slots,
                                            fresh)
    with pytest.raises(ValueError, match="dtypes"):
        gdd.gated_delta_decode_gates_triton(*qkv, a, b, A_log.double(), dt_bias, pool, slots,
                                            fresh)
