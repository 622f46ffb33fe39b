"""The hybrids' gated shared expert: ``shared_expert_ref`` against the formula, the two fused
launches (``shared_expert_triton``, interpreter on CPU) against the reference, and the entry
``shared_expert_add`` on both paths (the kernel for one row only). With the routed output
given as the fused MoE's pair rows (``RoutedPairs``, issue 17): the one-row kernel sums them in
its epilogue, bit for bit what the combine's launch and then the add give, and the result is
still ``shared_expert_ref`` of ``fused_moe_ref``'s output. CUDA (bf16, the model's shapes, a
CUDA graph): tests/gpu/test_hybrid_kernels_gpu.py.

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
from epserve.kernels.moe import RoutedPairs, combine_pairs_ref, fused_moe_pairs, fused_moe_ref
from epserve.kernels.shared_expert import shared_expert_add, shared_expert_ref

_NAMES = ("shared_expert", "linear", "fused_moe", "moe_align")
_MODS = interpreted_modules(*_NAMES)
sek, _, fmt, _ = _MODS
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


# --------------------------------------------------------------------------- routed pair rows


def _pairs(t, h, k, dtype, seed, offset=3, num_local=4):
    """``RoutedPairs`` of t tokens: random pair rows, ids over 10 experts of which
    ``[offset, offset + num_local)`` are local; every token has a non-local pair and (k > 1) a
    local one; the non-local rows are NaN (never to be read)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(10, generator=gen)[:k] for _ in range(t)])
    ids[:, -1] = (offset + num_local + torch.arange(t)) % 10  # a non-local pair
    if k > 1:
        ids[:, 0] = offset + torch.arange(t) % num_local  # and a local one
    y = torch.randn(t * k, h, generator=gen).to(dtype)
    local = ((ids >= offset) & (ids < offset + num_local)).reshape(-1)
    y[~local] = float("nan")
    return RoutedPairs(y, ids, offset, num_local)


def test_the_pairs_stand_for_their_combine():
    """The reference of routed pairs: the float32 sum of each token's local pair rows."""
    x, _, w_gu, w_d, w_g = _case(3, 16, 8)
    pairs = _pairs(3, 16, 4, torch.float32, seed=1)
    y, ids = pairs.y.view(3, 4, 16).double(), pairs.ids
    local = (ids >= 3) & (ids < 7)
    routed = torch.where(local[..., None], y, 0.0).sum(1).float()  # [T, H]
    assert torch.isfinite(routed).all()
    torch.testing.assert_close(combine_pairs_ref(pairs), routed)
    torch.testing.assert_close(shared_expert_ref(x, pairs, w_gu, w_d, w_g),
                               shared_expert_ref(x, routed, w_gu, w_d, w_g))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("h,i,k,wide", [(64, 32, 8, 0), (48, 24, 3, 0), (40, 12, 2, 8),
                                        (16, 1, 1, 0)], ids=lambda v: str(v))
def test_pairs_epilogue_is_the_combine_then_the_add(h, i, k, wide, dtype, interpret,
                                                    monkeypatch):
    """The one-row kernel given the pair rows: bit for bit the combine's launch and then the
    kernel with the routed row (the same float32 sum, rounded to the dtype where the combine
    stores it); within the dtype's rounding of the reference."""
    x, _, w_gu, w_d, w_g = _case(1, h, i, dtype, seed=h + k, wide=wide)
    pairs = _pairs(1, h, k, dtype, seed=k)  # k == 1: the one pair non-local, routed zero
    got = sek.shared_expert_pairs_triton(x, pairs.y, pairs.ids, w_gu, w_d, w_g, 3, 4)
    routed = fmt.combine_pairs_triton(pairs.y, pairs.ids, 3, 4)
    assert torch.isfinite(got).all() and routed.any() == (k > 1)
    assert torch.equal(got, sek.shared_expert_triton(x, routed, w_gu, w_d, w_g))
    monkeypatch.delenv("TRITON_INTERPRET")
    want = shared_expert_ref(x, pairs, w_gu, w_d, w_g)
    torch.testing.assert_close(got.float(), want.float(),
                               **(FP32 if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("rows", [1, 3])
def test_entry_takes_the_routed_pairs(path, rows, monkeypatch):
    """One row on the interpreted path: the two launches, no combine of its own; more rows:
    the combine's launch, then the elementwise launches; equal to the reference either way."""
    x, _, w_gu, w_d, w_g = _case(rows, 48, 16, seed=rows)
    pairs = _pairs(rows, 48, 3, torch.float32, seed=rows)
    with monkeypatch.context() as m:
        m.delenv("TRITON_INTERPRET", raising=False)
        want = shared_expert_ref(x, pairs, w_gu, w_d, w_g)
    calls = []
    if path == "interpreter":
        for mod, name in ((sek, "shared_expert_pairs_triton"), (sek, "gate_add_triton"),
                          (fmt, "combine_pairs_triton")):
            monkeypatch.setattr(mod, name, lambda *a, _r=getattr(mod, name), _n=name:
                                calls.append(_n) or _r(*a))
        monkeypatch.setattr(se, "shared_expert_ref", lambda *a: pytest.fail("unfused"))
    got = shared_expert_add(x, pairs, w_gu, w_d, w_g)
    torch.testing.assert_close(got, want, **FP32)
    fused = (["shared_expert_pairs_triton"] if rows == 1
             else ["combine_pairs_triton", "gate_add_triton"])
    assert calls == (fused if path == "interpreter" else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_moe_pairs_through_the_entry_are_the_references(path, dtype):
    """``fused_moe_pairs`` into ``shared_expert_add`` at one row (a batch-1 decode layer; this
    shard holds experts 2..4 of 6): ``shared_expert_ref`` of ``fused_moe_ref``'s output. (Not
    bf16: the interpreter's bf16 dot in the MoE GEMMs is not CUDA's.)"""
    x, _, w_gu, w_d, w_g = _case(1, 32, 24, dtype, seed=9)
    gen = torch.Generator().manual_seed(9)
    w13 = (torch.randn(3, 2 * 16, 32, generator=gen) * 32 ** -0.5).to(dtype)
    w2 = (torch.randn(3, 32, 16, generator=gen) * 0.25).to(dtype)
    ids, wts = torch.tensor([[3, 0, 4, 5]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    routed = fused_moe_pairs(x, w13, w2, ids, wts, expert_offset=2)
    assert isinstance(routed, RoutedPairs) == (path == "interpreter")
    got = shared_expert_add(x, routed, w_gu, w_d, w_g)
    want = shared_expert_ref(x, fused_moe_ref(x, w13, w2, ids, wts, expert_offset=2), w_gu,
                             w_d, w_g)
    torch.testing.assert_close(got.float(), want.float(),
                               **(FP32 if dtype == torch.float32 else BF16))


def test_pairs_errors():
    x, _, w_gu, w_d, w_g = _case(2, 16, 8)
    pairs = _pairs(3, 16, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match="routed pairs"):
        shared_expert_add(x, pairs, w_gu, w_d, w_g)
    with pytest.raises(ValueError, match="contiguous"):
        RoutedPairs(pairs.y.T.contiguous().T, pairs.ids, 3, 4)
    with pytest.raises(ValueError, match=r"\[T \* K, H\]"):
        RoutedPairs(pairs.y[:5], pairs.ids, 3, 4)


@needs_triton
def test_pairs_kernel_errors(interpret):
    x, _, w_gu, w_d, w_g = _case(1, 16, 8)
    pairs = _pairs(1, 16, 2, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"\[K, H\]"):
        sek.shared_expert_pairs_triton(x, pairs.y[:1], pairs.ids, w_gu, w_d, w_g, 3, 4)
    with pytest.raises(ValueError, match="dtypes"):
        sek.shared_expert_pairs_triton(x, pairs.y.double(), pairs.ids, w_gu, w_d, w_g, 3, 4)
