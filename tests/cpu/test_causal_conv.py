"""The causal conv over per-slot states: ``causal_conv_step`` on both paths (reference, and the
interpreted decode kernel) against ``causal_conv1d_ref`` over the gathered states, and the
Triton update kernel itself (interpreter on CPU).

Each case has a pool of random states, shuffled slots, fresh sequences whose slot holds
garbage (never read) and one padded row at the spare slot: only the sequences' slots change.
The conv is a K-term sum in float32 in both, so fp32 agrees to rounding and bf16 outputs to
one bf16 ulp; shifted state entries are copies (exact).
"""

from __future__ import annotations

import pytest
import torch
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

from epserve.kernels.causal_conv import causal_conv1d_ref, causal_conv_step

_NAMES = ("causal_conv_update",)
_MODS = interpreted_modules(*_NAMES)
ccu, = _MODS
assert ccu is None or ccu.INTERPRETED
interpret, path = kernel_fixtures(_NAMES, _MODS)

SPARE = 0  # the pool's spare slot: padded rows name it


def _case(s, c, kw, dtype, pool_dtype, seed, n_slots=9):
    """x [s, c] (a strided view, as the layer's projection split), weight, a random pool, s - 1
    real sequences on shuffled distinct slots (1 and 3 fresh) and a padded last row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, c + 5, generator=g).to(dtype)[:, 2:2 + c]
    weight = (torch.randn(c, kw, generator=g) * 0.5).to(dtype)
    pool = torch.randn(n_slots, c, kw - 1, generator=g).to(pool_dtype)
    slots = torch.randperm(n_slots - 1, generator=g)[:s] + 1
    slots[-1] = SPARE
    fresh = torch.zeros(s, dtype=torch.bool)
    fresh[[i for i in (1, 3) if i < s]] = True
    fresh[-1] = True  # a padded row is a fresh one-token sequence
    return x, weight, pool, slots, fresh


def _want(x, weight, pool, slots, fresh, cu):
    state = pool[slots].masked_fill(fresh[:, None, None], 0)
    y, new = causal_conv1d_ref(x, weight, state, cu)
    want_pool = pool.clone()
    want_pool[slots] = new.to(pool.dtype)
    return y, want_pool


def _check_pool(got, want, slots, tol):
    """Every slot but the spare as the reference left it (the spare: anything)."""
    keep = torch.ones(got.shape[0], dtype=torch.bool)
    keep[SPARE] = False
    torch.testing.assert_close(got[keep], want[keep], **tol)


@pytest.mark.parametrize("kw", [2, 4])
def test_decode_step_reads_and_writes_only_its_slots(path, kw):
    s, c = 6, 20
    x, w, pool, slots, fresh = _case(s, c, kw, torch.float32, torch.float32, seed=kw)
    cu = list(range(s + 1))
    want_y, want_pool = _want(x, w, pool, slots, fresh, cu)
    y = causal_conv_step(x, w, pool, slots, fresh, tuple(cu), decode=True)
    torch.testing.assert_close(y, want_y, atol=1e-6, rtol=1e-5)
    _check_pool(pool, want_pool, slots, dict(atol=0, rtol=0))
    assert torch.equal(pool[slots[1], :, -1], x[1])  # fresh: zeros, then this input
    assert not pool[slots[1], :, :-1].any()


def test_prefill_then_decode_steps_carry_the_state(path):
    """Two sequences, 11 prompt tokens each in one prefill step, then three decode steps
    (interpreter path: the kernel) give one reference call over all 14 tokens."""
    c, kw = 12, 4
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 14, c, generator=g)
    w = torch.randn(c, kw, generator=g)
    pool = torch.randn(5, c, kw - 1, generator=g)
    slots, fresh = torch.tensor([3, 1]), torch.tensor([True, False])
    start = pool[1].clone()
    ys = [causal_conv_step(x[:, :11].reshape(22, c), w, pool, slots, fresh, (0, 11, 22),
                           decode=False).view(2, 11, c)]
    for t in range(11, 14):
        ys.append(causal_conv_step(x[:, t], w, pool, slots, torch.zeros(2, dtype=torch.bool),
                                   (0, 1, 2), decode=True)[:, None])
    state0 = torch.stack([torch.zeros(c, kw - 1), start])
    want_y, want_state = causal_conv1d_ref(x.reshape(28, c), w, state0, [0, 14, 28])
    torch.testing.assert_close(torch.cat(ys, 1).reshape(28, c), want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], want_state, atol=1e-6, rtol=0)


@needs_triton
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32),
                                              (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "bf16-fp32pool"])
@pytest.mark.parametrize("c,kw", [(7, 3), (40, 4)], ids=lambda v: str(v))
def test_update_kernel_matches_ref(c, kw, dtype, pool_dtype, interpret):
    s = 5
    x, w, pool, slots, fresh = _case(s, c, kw, dtype, pool_dtype, seed=c + kw)
    want_y, want_pool = _want(x, w, pool, slots, fresh, list(range(s + 1)))
    y = ccu.causal_conv_update_triton(x, w, pool, slots, fresh)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(y, want_y, **tol)
    assert y.dtype == dtype
    _check_pool(pool, want_pool, slots, dict(atol=0, rtol=0))


@needs_triton
def test_update_kernel_errors(interpret):
    x, w, pool, slots, fresh = _case(3, 8, 4, torch.float32, torch.float32, seed=9)
    with pytest.raises(ValueError, match="state pool"):
        ccu.causal_conv_update_triton(x, w, pool[:, :, :2], slots, fresh)
    with pytest.raises(ValueError, match="slots"):
        ccu.causal_conv_update_triton(x, w, pool, slots.float(), fresh)
    with pytest.raises(ValueError, match="fresh"):
        ccu.causal_conv_update_triton(x, w, pool, slots, fresh[:2])
    with pytest.raises(ValueError, match="rows for"):
        ccu.causal_conv_update_triton(x[:2], w, pool, slots, fresh)
    with pytest.raises(ValueError, match="conv width"):
        ccu.causal_conv_update_triton(x, w[:, :1], pool[:, :, :0], slots, fresh)
    with pytest.raises(ValueError, match="contiguous last dim"):
        ccu.causal_conv_update_triton(x, w.t().contiguous().t(), pool, slots, fresh)
    assert ccu.causal_conv_update_triton(x[:0], w, pool, slots[:0], fresh[:0]).shape == (0, 8)


def test_step_errors():
    x, w, pool, slots, fresh = _case(3, 8, 4, torch.float32, torch.float32, seed=9)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv_step(x, w, pool, slots, fresh, (0, 1, 3), decode=False)
    with pytest.raises(ValueError, match="rows for"):
        causal_conv_step(x[:2], w, pool, slots, fresh, (0, 1, 2, 2), decode=True)
    with pytest.raises(ValueError, match="weight"):
        causal_conv_step(x, w[:5], pool, slots, fresh, (0, 1, 2, 3), decode=True)
