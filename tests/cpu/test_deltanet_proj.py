"""A DeltaNet layer's projections (``epserve.kernels.deltanet_proj``): the input projection with
the causal-conv update in its epilogue at one row (the kernel, interpreter on CPU, against its
reference, the two ops' references in order, and against the two launches it replaces), and
the gated norm then the output projection, two launches; the entries on both paths (fused for
one decode row only). CUDA (bf16, the model's
shapes, a CUDA graph): tests/gpu/test_hybrid_kernels_gpu.py.

Bars: fp32 within 1e-5 (float32 sums in another order; the interpreted fused launch equals the
two interpreted launches exactly, as they sum in the same order); bf16 within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

import epserve.kernels.deltanet_proj as dp
from epserve.kernels.deltanet_proj import (gated_norm_out_proj, gated_norm_out_proj_ref,
                                           in_proj_conv, in_proj_conv_ref)

_NAMES = ("deltanet_proj", "linear", "causal_conv_update", "norm")
_MODS = interpreted_modules(*_NAMES)
dpk, lin, conv, norm = _MODS
assert dpk is None or dpk.INTERPRETED
interpret, path = kernel_fixtures(_NAMES, _MODS)

FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


def _in_case(n, c, h, kw, dtype=torch.float32, seed=0, fresh=False, slots=5):
    """x [1, H], w_in [N, H] (rows of a wider tensor), conv_weight [C, K], a random conv pool
    (strided: a slice of a wider one), the sequence's slot and fresh flag."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, h, generator=gen).to(dtype)
    w_in = (torch.randn(n, h + 3, generator=gen) * h ** -0.5)[:, :h].to(dtype)
    cw = (torch.randn(c, kw, generator=gen) * 0.5).to(dtype)
    pool = torch.randn(slots, c + 2, kw - 1, generator=gen).to(dtype)[:, 1:c + 1]
    return x, w_in, cw, pool, torch.tensor([3]), torch.tensor([fresh])


def _out_case(hv, dv, h, dtype=torch.float32, seed=0):
    """o [1, Hv, Dv], z a view of a wider projection row, the norm weight, w_out [H, Hv Dv]."""
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(1, hv, dv, generator=gen).to(dtype)
    proj = torch.randn(1, hv * dv + 7, generator=gen).to(dtype)
    z = proj[:, 5:5 + hv * dv].view(1, hv, dv)
    nw = (1 + 0.3 * torch.randn(dv, generator=gen)).to(dtype)
    w_out = (torch.randn(h, hv * dv, generator=gen) * (hv * dv) ** -0.5).to(dtype)
    return o, z, nw, 1e-6, w_out


@needs_triton
@pytest.mark.parametrize("n,c,h,kw,fresh", [(40, 24, 32, 4, False), (40, 24, 32, 4, True),
                                             (9, 9, 20, 2, False), (30, 12, 48, 3, False)],
                         ids=lambda v: str(v))
def test_in_proj_conv_kernel(n, c, h, kw, fresh, interpret, monkeypatch):
    x, w_in, cw, pool, slots, fr = _in_case(n, c, h, kw, seed=n + h, fresh=fresh)
    want_pool, two_pool = pool.clone(), pool.clone()
    out = dpk.in_proj_conv_triton(x, w_in, cw, pool, slots, fr)
    # the two launches it replaces, interpreted: the same bits
    proj = lin.linear_gemv_triton(x, w_in)
    y2 = conv.causal_conv_update_triton(proj[:, :c], cw, two_pool, slots, fr)
    assert torch.equal(out[:, :c], y2) and torch.equal(out[:, c:], proj[:, c:])
    assert torch.equal(pool, two_pool)
    monkeypatch.delenv("TRITON_INTERPRET")
    y, rest = in_proj_conv_ref(x, w_in, cw, want_pool, slots, fr)
    torch.testing.assert_close(out[:, :c], y, **FP32)
    torch.testing.assert_close(out[:, c:], rest, **FP32)
    torch.testing.assert_close(pool, want_pool, **FP32)


@needs_triton
def test_in_proj_conv_kernel_bf16(interpret, monkeypatch):
    x, w_in, cw, pool, slots, fr = _in_case(48, 32, 64, 4, torch.bfloat16, seed=2)
    want_pool = pool.clone()
    out = dpk.in_proj_conv_triton(x, w_in, cw, pool, slots, fr)
    monkeypatch.delenv("TRITON_INTERPRET")
    y, rest = in_proj_conv_ref(x, w_in, cw, want_pool, slots, fr)
    torch.testing.assert_close(out.float(), torch.cat([y, rest], 1).float(), **BF16)
    torch.testing.assert_close(pool.float(), want_pool.float(), **BF16)


@pytest.mark.parametrize("rows,decode", [(1, True), (2, True), (3, False)],
                         ids=["one_row", "two_rows", "prefill"])
def test_entries_on_both_paths(path, rows, decode, monkeypatch):
    """The layer's calls: equal to the references (the conv from each sequence's state, one
    sequence of 3 tokens for the prefill); on the interpreter a one-row decode takes one fused
    launch for the projection and conv (not the conv's own kernel), then the gated norm's and
    the GEMV's."""
    _, w_in, cw, pool, _, _ = _in_case(30, 20, 16, 4, seed=rows)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(rows, 16, generator=gen)
    slots = torch.tensor([4, 1][:rows]) if decode else torch.tensor([4])
    fresh = torch.zeros(len(slots), dtype=torch.bool)
    cu = tuple(range(rows + 1)) if decode else (0, rows)
    _, _, nw, eps, w_out = _out_case(2, 10, 16, seed=rows)
    o = torch.randn(rows, 2, 10, generator=gen)
    z = torch.randn(rows, 2 * 10 + 3, generator=gen)[:, 3:].view(rows, 2, 10)
    want_pool = pool.clone()
    with monkeypatch.context() as m:
        m.delenv("TRITON_INTERPRET", raising=False)
        want_y, want_rest = in_proj_conv(x, w_in, cw, want_pool, slots, fresh, cu, decode)
        want_out = gated_norm_out_proj(o, z, nw, eps, w_out)
    fused = path == "interpreter" and rows == 1
    with monkeypatch.context() as m:
        if fused:
            m.setattr(conv, "causal_conv_update_triton",
                      lambda *a: pytest.fail("causal_conv_update_triton: not fused"))
            m.setattr(dp, "linear", lambda *a: pytest.fail("linear: not fused"))
        y, rest = in_proj_conv(x, w_in, cw, pool, slots, fresh, cu, decode)
    calls = []
    if path == "interpreter":
        real = norm.gated_rms_norm_triton
        monkeypatch.setattr(norm, "gated_rms_norm_triton",
                            lambda *a: calls.append("norm") or real(*a))
    out = gated_norm_out_proj(o, z, nw, eps, w_out)
    assert calls == (["norm"] if path == "interpreter" else [])
    torch.testing.assert_close(y, want_y, **FP32)
    torch.testing.assert_close(rest, want_rest, **FP32)
    torch.testing.assert_close(pool, want_pool, **FP32)
    torch.testing.assert_close(out, want_out, **FP32)
    torch.testing.assert_close(out, gated_norm_out_proj_ref(o, z, nw, eps, w_out), **FP32)


def test_entry_errors():
    x, w_in, cw, pool, slots, fresh = _in_case(10, 8, 16, 4)
    with pytest.raises(ValueError, match="w_in"):
        in_proj_conv(x, w_in[:4], cw, pool, slots, fresh, (0, 1), True)
    o, z, nw, eps, w_out = _out_case(2, 8, 16)
    with pytest.raises(ValueError, match="w_out"):
        gated_norm_out_proj(o, z, nw, eps, w_out[:, :8])
    with pytest.raises(ValueError, match="norm_weight"):
        gated_norm_out_proj(o, z, nw[:4], eps, w_out)


@needs_triton
def test_kernel_errors(interpret):
    x, w_in, cw, pool, slots, fresh = _in_case(10, 8, 16, 4)
    with pytest.raises(ValueError, match="conv_weight"):
        dpk.in_proj_conv_triton(x, w_in, torch.zeros(12, 4), pool, slots, fresh)
    with pytest.raises(ValueError, match="state pool"):
        dpk.in_proj_conv_triton(x, w_in, cw, pool[:, :4], slots, fresh)
    with pytest.raises(ValueError, match="one of"):
        dpk.in_proj_conv_triton(x, w_in.double(), cw, pool, slots, fresh)
