"""The fused residual-add + RMSNorm + router + top-K launch (Triton interpreter on CPU) against
its definition ``add_norm_router_ref``, and the public entry's choice of path.

Bar: fp32 normed / new residual within 1e-6 relative, ids equal, weights within 1e-5; fp16 /
bf16 normed and new residual within two units in the last place (the interpreter emulates
bf16 on numpy floats), and the picked experts are a
top-K of the reference logits (bf16 rounding makes exact logit ties common, and both sides break
them the same way only when their float32 sums round alike). The arrival counters are back at
zero after each launch (the next launch, or a graph replay, starts clean).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from interp import import_interpreted  # noqa: E402

_MODS = ("epserve.kernels.router_triton", "epserve.kernels.norm_router_triton")
for _m in _MODS:  # fresh interpreted copies, dropped again so a CUDA import compiles for real
    sys.modules.pop(_m, None)
rt = import_interpreted(_MODS[0])
nrt = import_interpreted(_MODS[1])
for _m in _MODS:
    sys.modules.pop(_m, None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from epserve.kernels.router import MAX_FUSED_TOKENS, add_norm_router, add_norm_router_ref  # noqa: E402

assert type(nrt._norm_router_kernel).__name__ == "InterpretedFunction"


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, _MODS[0], rt)
    monkeypatch.setitem(sys.modules, _MODS[1], nrt)


def _inputs(t, h, e, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    res = torch.randn(t, h, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    gw = (torch.randn(e, h, generator=g) / h ** 0.5 * 4).to(dtype)
    return x, res, nw, gw


@pytest.mark.parametrize("t,h,e,k,renorm,block_e", [
    (1, 64, 8, 2, False, None),     # one program per row
    (1, 96, 128, 8, True, 4),       # 32 programs meet at the counter; H not a power of two
    (3, 64, 60, 4, True, 8),        # E not a power of two: the last block is partial
    (MAX_FUSED_TOKENS, 32, 16, 1, False, 2),
])
def test_fp32_matches_reference(t, h, e, k, renorm, block_e):
    x, res, nw, gw = _inputs(t, h, e)
    got = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, k, renorm, block_e=block_e)
    ref = add_norm_router_ref(x, res, nw, 1e-6, gw, k, renorm)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    assert torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[3], ref[3], rtol=1e-5, atol=1e-6)
    assert not nrt._counters(x.device).any(), "a launch left an arrival counter set"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_picks_a_top_k(dtype):
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


def test_repeated_launches_agree():
    """The counters a launch resets serve the next: same inputs, same result, twice over."""
    x, res, nw, gw = _inputs(2, 64, 32)
    a = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, 4, True, block_e=4)
    b = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, 4, True, block_e=4)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_public_entry_fuses_small_batches_and_splits_large_ones(monkeypatch):
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


@pytest.mark.parametrize("bad,match", [
    (dict(t=MAX_FUSED_TOKENS + 1), "T=65"),
    (dict(k=9), "top_k"),
    (dict(gw_dtype=torch.float16), "router_weight"),
    (dict(res_shape=(2, 32)), "residual"),
    (dict(block_e=3), "block_e"),
])
def test_bad_arguments_raise(bad, match):
    t = bad.get("t", 2)
    x, res, nw, gw = _inputs(t, 64, 8)
    if "gw_dtype" in bad:
        gw = gw.to(bad["gw_dtype"])
    if "res_shape" in bad:
        res = torch.zeros(bad["res_shape"])
    with pytest.raises(ValueError, match=match):
        nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, bad.get("k", 2), True,
                                   block_e=bad.get("block_e"))


def test_padding_rows_route_nowhere_and_the_moe_skips_them():
    """Rows whose KV slot is negative (a CUDA graph's padding) get ids -1 and weights 0; the
    other rows are routed as without slots, and the fused MoE gives the padding rows zeros."""
    from interp import import_interpreted

    t, h, e, k = 5, 64, 16, 4
    x, res, nw, gw = _inputs(t, h, e, seed=5)
    slots = torch.tensor([7, -1, 12, -1, 3])
    got = nrt.add_norm_router_triton(x, res, nw, 1e-6, gw, k, True, row_slots=slots, block_e=4)
    ref = add_norm_router_ref(x, res, nw, 1e-6, gw, k, True)
    assert got[2][1].tolist() == [-1] * k and got[3][1].tolist() == [0.0] * k
    for r in (0, 2, 4):
        assert torch.equal(got[2][r], ref[2][r])
        torch.testing.assert_close(got[3][r], ref[3][r], rtol=1e-5, atol=1e-6)
    fm = import_interpreted("epserve.kernels.fused_moe_triton")
    from epserve.kernels.moe import fused_moe_ref

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
