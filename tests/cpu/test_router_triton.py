"""topk_softmax_triton (Triton interpreter on CPU) against topk_softmax_ref, and the ref against
today's TopKRouter computation (softmax -> torch.topk -> renormalise) on untied inputs.

Bar: ids equal; weights within 1e-6 (abs) for every logits dtype (both upcast the same values to
float32 first). TRITON_INTERPRET=1 is set while the kernel module is imported (triton.jit picks
the interpreter at decoration time) and, through an autouse fixture, while each test runs; the
interpreted module is then dropped from sys.modules so a later CUDA import compiles for real.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

_prev = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    sys.modules.pop("epserve.kernels.router_triton", None)
    from epserve.kernels import router_triton as rt  # noqa: E402
finally:
    if _prev is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _prev
    sys.modules.pop("epserve.kernels.router_triton", None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from epserve.kernels.router import topk_softmax, topk_softmax_ref  # noqa: E402

assert type(rt._topk_softmax_kernel).__name__ == "InterpretedFunction"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "epserve.kernels.router_triton", rt)  # for topk_softmax


def _check(got, ref, k):
    (gi, gw), (ri, rw) = got, ref
    assert gi.dtype == torch.int64 and gw.dtype == torch.float32
    assert gi.shape == gw.shape == (ri.shape[0], k)
    assert torch.equal(gi, ri), (gi, ri)
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("renorm", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("e", [8, 60, 128])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_matches_ref(dt, e, k, renorm):
    g = torch.Generator().manual_seed(e * 10 + k)
    logits = (torch.randn(37, e, generator=g) * 3).to(DTYPES[dt])
    _check(rt.topk_softmax_triton(logits, k, renorm), topk_softmax_ref(logits, k, renorm), k)


@pytest.mark.parametrize("dt", list(DTYPES))
def test_exact_ties_go_to_lower_id(dt):
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


def test_degenerate_rows_follow_ref():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, 0.0, 1.0, 2.0], [inf, 0.0, 1.0, 2.0], [-inf] * 4,
                           [0.0, -2e4, -1e4, 3.0]])
    with warnings.catch_warnings():  # numpy, in the interpreter, may warn on inf - inf
        warnings.simplefilter("ignore", RuntimeWarning)
        got = rt.topk_softmax_triton(logits, 3, True)
    _check(got, topk_softmax_ref(logits, 3, True), 3)
    assert got[0][:3].tolist() == [[0, 1, 2]] * 3 and torch.isnan(got[1][:3]).all()


@pytest.mark.parametrize("block_t", [1, 4, 64])
def test_row_tiles_and_row_stride(block_t):
    g = torch.Generator().manual_seed(block_t)
    wide = torch.randn(45, 80, generator=g)
    logits = wide[:, :60]  # row stride 80, unit stride along experts
    ref = topk_softmax_ref(logits, 2, True)
    _check(rt.topk_softmax_triton(logits, 2, True, block_t=block_t), ref, 2)
    _check(rt.topk_softmax_triton(logits, 60, False), topk_softmax_ref(logits, 60, False), 60)


def test_empty_and_edge_shapes():
    ids, w = rt.topk_softmax_triton(torch.empty(0, 16), 4, True)
    assert ids.shape == w.shape == (0, 4) and ids.dtype == torch.int64
    one = torch.randn(3, 1)
    _check(rt.topk_softmax_triton(one, 1, False), topk_softmax_ref(one, 1, False), 1)
    big = torch.randn(5, 512)
    _check(rt.topk_softmax_triton(big, 8, True), topk_softmax_ref(big, 8, True), 8)


@pytest.mark.parametrize("renorm", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("e,k", [(8, 2), (60, 4), (128, 8)])
def test_ref_reproduces_todays_router(e, k, renorm):
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


def test_dispatch(monkeypatch):
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


def test_wrapper_rejects_bad_inputs(monkeypatch):
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
