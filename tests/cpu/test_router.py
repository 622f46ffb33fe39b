"""The router op: softmax + top-K (``topk_softmax``) and the fused residual-add + RMSNorm + router
+ top-K launch (``add_norm_router``), each Triton kernel (interpreter on CPU) against its torch
definition, the references against today's TopKRouter computation (softmax -> torch.topk ->
renormalise) on untied inputs, and the public entries' choice of path.

topk_softmax bar: ids equal; weights within 1e-6 (abs) for every logits dtype (both upcast the
same values to float32 first).

add_norm_router bar: fp32 normed / new residual within 1e-6 relative, ids equal, weights within
1e-5; fp16 / bf16 normed and new residual within two units in the last place (the interpreter
emulates bf16 on numpy floats), and the picked experts are a top-K of the reference logits
(bf16 rounding makes exact logit ties common, and both sides break them the same way only when
their float32 sums round alike). The arrival counters are back at zero after each launch (the
next launch, or a graph replay, starts clean).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

from epserve.kernels.moe import fused_moe_ref
from epserve.kernels.router import (MAX_FUSED_TOKENS, add_norm_router, add_norm_router_ref,
                                    topk_softmax, topk_softmax_ref)

_NAMES = ("router", "norm_router", "fused_moe")  # fused_moe: padding rows reach the MoE
_MODS = interpreted_modules(*_NAMES)
rt, nrt, fm = _MODS
assert rt is None or type(rt._topk_softmax_kernel).__name__ == "InterpretedFunction"
assert nrt is None or nrt.INTERPRETED
interpret, path = kernel_fixtures(_NAMES, _MODS)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------- softmax + top-K


def _check(got, ref, k):
    (gi, gw), (ri, rw) = got, ref
    assert gi.dtype == torch.int64 and gw.dtype == torch.float32
    assert gi.shape == gw.shape == (ri.shape[0], k)
    assert torch.equal(gi, ri), (gi, ri)
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-6, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("renorm", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("e", [8, 60, 128])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_matches_ref(dt, e, k, renorm, interpret):
    g = torch.Generator().manual_seed(e * 10 + k)
    logits = (torch.randn(37, e, generator=g) * 3).to(DTYPES[dt])
    _check(rt.topk_softmax_triton(logits, k, renorm), topk_softmax_ref(logits, k, renorm), k)


@needs_triton
@pytest.mark.parametrize("dt", list(DTYPES))
def test_exact_ties_go_to_lower_id(dt, interpret):
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-2, 3, (24, 60), generator=g).float()  # 5 values: ties everywhere
    logits[0] = 1.0  # a fully tied row: ids 0..K-1
    logits[1, :] = -1e4  # probs underflow to 0 except the max: ties among the zeros
    logits[1, 7] = 0.0
    logits = logits.to(DTYPES[dt])
    for renorm in (False, True):
        got = rt.topk_softmax_triton(logits, 8, renorm)
        _check(got, topk_softmax_ref(logits, 8, renorm), 8)
    ids = got[0]
    assert ids[0].tolist() == list(range(8))
    assert ids[1].tolist() == [7, 0, 1, 2, 3, 4, 5, 6]
    probs = torch.softmax(logits.float(), -1)
    picked = probs.gather(1, ids)
    assert torch.all(picked[:, :-1] >= picked[:, 1:])  # descending
    tie_next = picked[:, :-1] == picked[:, 1:]
    assert tie_next.any() and torch.all(ids[:, :-1][tie_next] < ids[:, 1:][tie_next])


@needs_triton
def test_degenerate_rows_follow_ref(interpret):
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, 0.0, 1.0, 2.0], [inf, 0.0, 1.0, 2.0], [-inf] * 4,
                           [0.0, -2e4, -1e4, 3.0]])
    with warnings.catch_warnings():  # numpy, in the interpreter, may warn on inf - inf
        warnings.simplefilter("ignore", RuntimeWarning)
        got = rt.topk_softmax_triton(logits, 3, True)
    _check(got, topk_softmax_ref(logits, 3, True), 3)
    assert got[0][:3].tolist() == [[0, 1, 2]] * 3 and torch.isnan(got[1][:3]).all()


@needs_triton
@pytest.mark.parametrize("block_t", [1, 4, 64])
def test_row_tiles_and_row_stride(block_t, interpret):
    g = torch.Generator().manual_seed(block_t)
    wide = torch.randn(45, 80, generator=g)
    logits = wide[:, :60]  # row stride 80, unit stride along experts
    ref = topk_softmax_ref(logits, 2, True)
    _check(rt.topk_softmax_triton(logits, 2, True, block_t=block_t), ref, 2)
    _check(rt.topk_softmax_triton(logits, 60, False), topk_softmax_ref(logits, 60, False), 60)


@needs_triton
def test_empty_and_edge_shapes(interpret):
    ids, w = rt.topk_softmax_triton(torch.empty(0, 16), 4, True)
    assert ids.shape == w.shape == (0, 4) and ids.dtype == torch.int64
    one = torch.randn(3, 1)
    _check(rt.topk_softmax_triton(one, 1, False), topk_softmax_ref(one, 1, False), 1)
    big = torch.randn(5, 512)
    _check(rt.topk_softmax_triton(big, 8, True), topk_softmax_ref(big, 8, True), 8)


@pytest.mark.parametrize("renorm", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("e,k", [(8, 2), (60, 4), (128, 8)])
def test_ref_reproduces_todays_router(e, k, renorm, path):
    g = torch.Generator().manual_seed(e + k)
    x, w = torch.randn(64, 32, generator=g), torch.randn(e, 32, generator=g) / 32 ** 0.5
    # today's TopKRouter.forward, inline (epserve/models/layers.py)
    probs = torch.softmax(F.linear(x, w).float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    assert all(torch.unique(row).numel() == e for row in probs)  # untied: the orders agree
    ref_ids, ref_w = topk_softmax_ref(F.linear(x, w), k, renorm)
    assert torch.equal(ref_ids, ids) and torch.equal(ref_w, weights)
    _check(topk_softmax(F.linear(x, w), k, renorm), (ids, weights), k)


@needs_triton
def test_dispatch(monkeypatch, interpret):
    logits = torch.randn(6, 16)
    calls = []
    real = rt.topk_softmax_triton
    monkeypatch.setattr(rt, "topk_softmax_triton",
                        lambda *a, **kw: calls.append(a[0].stride()) or real(*a, **kw))
    monkeypatch.delenv("TRITON_INTERPRET")
    ref = topk_softmax(logits, 2, True)
    assert not calls  # CPU without the interpreter: the reference
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check(topk_softmax(logits, 2, True), ref, 2)
    _check(topk_softmax(logits.t().contiguous().t(), 2, True), ref, 2)  # made contiguous
    assert calls == [(16, 1), (16, 1)]
    _check(topk_softmax(logits.double(), 2, True), ref, 2)  # other dtypes: the reference
    big = torch.randn(3, 600)
    _check(topk_softmax(big, 8, False), topk_softmax_ref(big, 8, False), 8)  # E > 512: ref
    assert len(calls) == 2
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax(logits, 17, True)


@needs_triton
def test_wrapper_rejects_bad_inputs(monkeypatch, interpret):
    logits = torch.randn(4, 16)
    f = rt.topk_softmax_triton
    for bad, match in [((logits[None], 2), "2-D"), ((logits.long(), 2), "floating"),
                       ((logits.double(), 2), "dtype"), ((logits, 0), "top_k"),
                       ((logits, 17), "top_k"), ((logits, 2.0), "int"), ((logits, True), "int"),
                       ((torch.randn(2, 513), 2), "512"), ((logits.t(), 2), "contiguous")]:
        with pytest.raises(ValueError, match=match):
            f(*bad, True)
    with pytest.raises(ValueError, match="block_t"):
        f(logits, 2, True, block_t=3)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        f(logits, 2, True)


# --------------------------------------------------------------------------- add + norm + router


def _inputs(t, h, e, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    res = torch.randn(t, h, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    gw = (torch.randn(e, h, generator=g) / h ** 0.5 * 4).to(dtype)
    return x, res, nw, gw


@needs_triton
@pytest.mark.parametrize("t,h,e,k,renorm,block_e", [
    (1, 64, 8, 2, False, None),     # one program per row
    (1, 96, 128, 8, True, 4),       # 32 programs meet at the counter; H not a power of two
    (3, 64, 60, 4, True, 8),        # E not a power of two: the last block is partial
    (MAX_FUSED_TOKENS, 32, 16, 1, False, 2),
])
def test_fp32_matches_reference(t, h, e, k, renorm, block_e, interpret):
    x, res, nw, gw = _inputs(t, h, e)
    got = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, k, renorm, block_e=block_e)
    ref = add_norm_router_ref(x, res, nw, 1e-6, gw, k, renorm)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    assert torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[3], ref[3], rtol=1e-5, atol=1e-6)
    assert not nrt._counters(x.device).any(), "a launch left an arrival counter set"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_picks_a_top_k(dtype, interpret):
    t, h, e, k = 4, 128, 32, 4
    x, res, nw, gw = _inputs(t, h, e, dtype, seed=1)
    normed, new_res, ids, w = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, k, True,
                                                         block_e=8)
    ref_normed, ref_res, _, _ = add_norm_router_ref(x, res, nw, 1e-6, gw, k, True)
    # one unit in the last place (the interpreter emulates bf16 rounding on numpy floats)
    torch.testing.assert_close(new_res, ref_res)
    torch.testing.assert_close(normed.float(), ref_normed.float(), rtol=3e-2, atol=1e-2)
    logits = F.linear(normed.float(), gw.float())  # [T, E]
    tol = 2e-2 * logits.abs().max()
    for r in range(t):
        picked = logits[r, ids[r]]
        others = logits[r][~torch.isin(torch.arange(e), ids[r])]
        assert picked.min() >= others.max() - tol, (r, ids[r])
        assert torch.all(picked[:-1] >= picked[1:] - tol)  # descending
    torch.testing.assert_close(w.sum(1), torch.ones(t), rtol=1e-5, atol=1e-5)


@needs_triton
def test_repeated_launches_agree(interpret):
    """The counters a launch resets serve the next: same inputs, same result, twice over."""
    x, res, nw, gw = _inputs(2, 64, 32)
    a = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, 4, True, block_e=4)
    b = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, 4, True, block_e=4)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@needs_triton
def test_public_entry_fuses_small_batches_and_splits_large_ones(monkeypatch, interpret):
    calls = []
    real = nrt.add_norm_router_triton
    monkeypatch.setattr(nrt, "add_norm_router_triton",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for t in (2, MAX_FUSED_TOKENS + 1):
        x, res, nw, gw = _inputs(t, 64, 8, seed=t)
        got = add_norm_router(x, res, nw, 1e-6, gw, 2, True)
        ref = add_norm_router_ref(x, res, nw, 1e-6, gw, 2, True)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(got[2], ref[2])
        torch.testing.assert_close(got[3], ref[3], rtol=1e-5, atol=1e-6)
    assert calls == [2]  # 65 rows ran the three separate launches


@needs_triton
@pytest.mark.parametrize("bad,match", [
    (dict(t=MAX_FUSED_TOKENS + 1), "T=65"),
    (dict(k=9), "top_k"),
    (dict(gw_dtype=torch.float16), "router_weight"),
    (dict(res_shape=(2, 32)), "residual"),
    (dict(block_e=3), "block_e"),
])
def test_bad_arguments_raise(bad, match, interpret):
    t = bad.get("t", 2)
    x, res, nw, gw = _inputs(t, 64, 8)
    if "gw_dtype" in bad:
        gw = gw.to(bad["gw_dtype"])
    if "res_shape" in bad:
        res = torch.zeros(bad["res_shape"])
    with pytest.raises(ValueError, match=match):
        nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, bad.get("k", 2), True,
                                   block_e=bad.get("block_e"))


@needs_triton
def test_padding_rows_route_nowhere_and_the_moe_skips_them(interpret):
    """Rows whose KV slot is negative (a CUDA graph's padding) get ids -1 and weights 0; the
    other rows are routed as without slots, and the fused MoE gives the padding rows zeros."""
    t, h, e, k = 5, 64, 16, 4
    x, res, nw, gw = _inputs(t, h, e, seed=5)
    slots = torch.tensor([7, -1, 12, -1, 3])
    got = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, k, True, row_slots=slots, block_e=4)
    ref = add_norm_router_ref(x, res, nw, 1e-6, gw, k, True)
    assert got[2][1].tolist() == [-1] * k and got[3][1].tolist() == [0.0] * k
    for r in (0, 2, 4):
        assert torch.equal(got[2][r], ref[2][r])
        torch.testing.assert_close(got[3][r], ref[3][r], rtol=1e-5, atol=1e-6)
    g = torch.Generator().manual_seed(6)
    w13, w2 = torch.randn(e, 2 * 8, h, generator=g) / 8, torch.randn(e, h, 8, generator=g) / 4
    for rows in (1, 5):  # pair blocks (<= 16 pairs) and the aligned layout (20 pairs)
        xs = got[0][:rows] if rows == 1 else got[0]
        ids = got[2][1:2] if rows == 1 else got[2]
        wts = got[3][1:2] if rows == 1 else got[3]
        out = fm.fused_moe_triton(xs, w13, w2, ids, wts)
        torch.testing.assert_close(out, fused_moe_ref(xs, w13, w2, ids, wts), rtol=1e-5, atol=1e-5)
        pads = [0] if rows == 1 else [1, 3]
        assert not out[pads].any()


@needs_triton
@pytest.mark.parametrize("t,e,k,block_e", [(1, 8, 2, None), (3, 60, 4, 8)])
def test_zero_centred_norm_matches_reference(t, e, k, block_e, interpret, monkeypatch):
    """The hybrids' pre-norm (``1 + w``, w around 0, added in float32) in the fused launch and
    through the public entry, on the kernel and on the reference path."""
    x, res, nw, gw = _inputs(t, 64, e, seed=5)
    nw = 0.02 * nw
    ref = add_norm_router_ref(x, res, nw, 1e-6, gw, k, True, zero_centred=True)
    plain = add_norm_router_ref(x, res, nw, 1e-6, gw, k, True)
    assert not torch.allclose(ref[0], plain[0])  # the flag matters
    got = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, k, True, block_e=block_e,
                                     zero_centred=True)
    entry = add_norm_router(x, res, nw, 1e-6, gw, k, True, zero_centred=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    on_ref = add_norm_router(x, res, nw, 1e-6, gw, k, True, zero_centred=True)
    for out in (got, entry, on_ref):
        torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(out[1], ref[1]) and torch.equal(out[2], ref[2])
        torch.testing.assert_close(out[3], ref[3], rtol=1e-5, atol=1e-6)
