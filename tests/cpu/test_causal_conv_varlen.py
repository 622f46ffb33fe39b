"""The causal conv's short varlen kernel (a speculative verify's k + 1 tokens a sequence, a fold's
accepted prefix; interpreter on CPU) against ``causal_conv1d_ref`` over the gathered states, and
``causal_conv_step`` routing a short non-decode step to it.

Each case packs sequences of 1..6 tokens (strided x rows, as the layer's projection split) on
shuffled slots of a random pool: one fresh (its slot holds garbage, never read), one held (its
slot must not change), one shorter than the window (its new state keeps old columns). Every
other slot is untouched. The conv is a K-term float32 sum in both, so fp32 agrees to rounding
and fp16/bf16 outputs to an ulp; new state entries are copies (exact).
"""

from __future__ import annotations

import pytest
import torch
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

from epserve.kernels.causal_conv import causal_conv1d_ref, causal_conv_step
from epserve.kernels.dispatch import MAX_CONV_WIDTH, MAX_SHORT_TOKENS

_NAMES = ("causal_conv_update",)
_MODS = interpreted_modules(*_NAMES)
ccu, = _MODS
assert ccu is None or ccu.INTERPRETED
interpret, path = kernel_fixtures(_NAMES, _MODS)

LENS = (3, 1, 6, 2, 5, 4)
FRESH, HELD = 2, 3  # sequence 1 (one token) is shorter than the window for K >= 3
EXACT = dict(atol=0, rtol=0)


def _case(lens, c, kw, dtype, pool_dtype, seed, n_slots=11, fresh_at=FRESH):
    """x [T, c] (a strided view), weight [c, kw], a random pool, distinct shuffled slots (pool
    slots beyond them untouched), fresh flags and the host offsets."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    x = torch.randn(t, c + 5, generator=g).to(dtype)[:, 2:2 + c]
    weight = (torch.randn(c, kw, generator=g) * 0.5).to(dtype)
    pool = torch.randn(n_slots, c, kw - 1, generator=g).to(pool_dtype)
    slots = torch.randperm(n_slots, generator=g)[:len(lens)]
    fresh = torch.zeros(len(lens), dtype=torch.bool)
    fresh[fresh_at] = True
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return x, weight, pool, slots, fresh, cu


def _want(x, weight, pool, slots, fresh, cu, hold):
    """The reference's outputs and the pool it leaves: new states at the unheld slots."""
    state = pool[slots].masked_fill(fresh[:, None, None], 0)
    y, new = causal_conv1d_ref(x, weight, state, cu)
    want = pool.clone()
    keep = [s for s in range(len(slots)) if s not in hold]
    want[slots[keep]] = new[keep].to(pool.dtype)
    return y, want


def _tol(dtype):
    return {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}[dtype]


@needs_triton
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32),
                                              (torch.float16, torch.float16),
                                              (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)],
                         ids=["fp32", "fp16", "bf16", "bf16-fp32pool"])
@pytest.mark.parametrize("c,kw", [(7, 2), (40, 3), (24, 4)], ids=lambda v: str(v))
def test_varlen_kernel_matches_ref(c, kw, dtype, pool_dtype, interpret):
    x, w, pool, slots, fresh, cu = _case(LENS, c, kw, dtype, pool_dtype, seed=c + kw)
    before = pool.clone()
    want_y, want_pool = _want(x, w, pool, slots, fresh, cu, {HELD})
    hold_mask = torch.zeros(len(LENS), dtype=torch.bool)
    hold_mask[HELD] = True
    cu_dtype = torch.int32 if kw % 2 else torch.int64  # both offset dtypes
    y = ccu.causal_conv_varlen_triton(x, w, pool, slots, fresh, torch.tensor(cu, dtype=cu_dtype),
                                      hold_mask)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y, want_y, **_tol(dtype))
    torch.testing.assert_close(pool, want_pool, **EXACT)  # others (and the held slot) untouched
    assert torch.equal(pool[slots[HELD]], before[slots[HELD]])


@needs_triton
def test_varlen_kernel_multiple_channel_blocks_no_silu_empty_sequences(interpret):
    """C over one 512-lane block, no SiLU, a uint8 hold mask holding nothing, and two empty
    sequences (outside the reference's reach: compared with it over the others), whose states
    stay as they were (zeros for the fresh one)."""
    lens = (2, 0, 1, 0)
    x, w, pool, slots, fresh, cu = _case(lens, 520, 4, torch.float32, torch.float32, seed=3,
                                         fresh_at=3)
    full = [0, 2]  # the sequences with tokens
    state = pool[slots[full]].masked_fill(fresh[full][:, None, None], 0)
    want_y, new = causal_conv1d_ref(x, w, state, [0, 2, 3], silu=False)
    want = pool.clone()
    want[slots[full]] = new
    want[slots[3]] = 0
    y = ccu.causal_conv_varlen_triton(x, w, pool, slots, fresh, torch.tensor(cu),
                                      torch.zeros(len(lens), dtype=torch.uint8), silu=False)
    torch.testing.assert_close(y, want_y, **_tol(torch.float32))
    torch.testing.assert_close(pool, want, **EXACT)


@needs_triton
def test_varlen_kernel_errors(interpret):
    x, w, pool, slots, fresh, cu = _case(LENS, 8, 4, torch.float32, torch.float32, seed=9)
    cu_t, hold = torch.tensor(cu), torch.zeros(len(LENS), dtype=torch.bool)
    f = ccu.causal_conv_varlen_triton
    with pytest.raises(ValueError, match="cu"):
        f(x, w, pool, slots, fresh, cu_t[:-1], hold)
    with pytest.raises(ValueError, match="cu"):
        f(x, w, pool, slots, fresh, cu_t.float(), hold)
    with pytest.raises(ValueError, match="hold_mask"):
        f(x, w, pool, slots, fresh, cu_t, hold[1:])
    with pytest.raises(ValueError, match="conv width"):
        f(x, w[:, :1], pool[:, :, :0], slots, fresh, cu_t, hold)
    wide = torch.zeros(8, MAX_CONV_WIDTH + 1)
    with pytest.raises(ValueError, match="conv width"):
        f(x, wide, torch.zeros(11, 8, MAX_CONV_WIDTH), slots, fresh, cu_t, hold)
    with pytest.raises(ValueError, match="state pool"):
        f(x, w, pool[:, :, :2], slots, fresh, cu_t, hold)
    with pytest.raises(ValueError, match="fresh"):
        f(x, w, pool, slots, fresh[:2], cu_t, hold)
    with pytest.raises(ValueError, match="contiguous last dim"):
        f(x, w.t().contiguous().t(), pool, slots, fresh, cu_t, hold)


@pytest.mark.parametrize("kw", [2, 4])
def test_short_step_on_both_paths(path, kw, monkeypatch):
    """A verify-like step (held sequence) through ``causal_conv_step``, twice on one offsets
    tuple (two layers: the device offsets are shared); the interpreter path runs the kernel."""
    calls = []
    if path == "interpreter":
        kernel = ccu.causal_conv_varlen_triton
        monkeypatch.setattr(ccu, "causal_conv_varlen_triton",
                            lambda *a, **k: calls.append(1) or kernel(*a, **k))
    cu = None
    for layer in range(2):
        x, w, pool, slots, fresh, cu_list = _case(LENS, 12, kw, torch.float32, torch.float32,
                                                  seed=10 * kw + layer)
        cu = cu or tuple(cu_list)
        want_y, want_pool = _want(x, w, pool, slots, fresh, cu, {HELD})
        y = causal_conv_step(x, w, pool, slots, fresh, cu, decode=False, hold=[HELD])
        torch.testing.assert_close(y, want_y, **_tol(torch.float32))
        torch.testing.assert_close(pool, want_pool, **EXACT)
    assert len(calls) == (2 if path == "interpreter" else 0)


def test_long_step_is_not_short(path, monkeypatch):
    """A sequence over ``MAX_SHORT_TOKENS`` tokens: not the short kernel (the reference here)."""
    if path == "interpreter":
        monkeypatch.setattr(ccu, "causal_conv_varlen_triton", None)  # calling it would fail
    x, w, pool, slots, fresh, cu = _case((2, MAX_SHORT_TOKENS + 1), 6, 3, torch.float32,
                                         torch.float32, seed=1, fresh_at=0)
    want_y, want_pool = _want(x, w, pool, slots, fresh, cu, set())
    y = causal_conv_step(x, w, pool, slots, fresh, tuple(cu), decode=False)
    torch.testing.assert_close(y, want_y, **_tol(torch.float32))
    torch.testing.assert_close(pool, want_pool, **EXACT)
