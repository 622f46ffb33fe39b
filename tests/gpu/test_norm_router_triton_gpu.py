"""The fused add + RMSNorm + router + top-K launch on CUDA at the Qwen3-30B-A3B shape (H=2048,
E=128, K=8, bf16) against ``add_norm_router_ref``: normed and new residual within one bf16 unit,
the picked experts a top-K of the reference logits, weights summing to 1; repeated CUDA-graph
replays give the same result (the arrival counters reset); prints microseconds per graph replay
against the three launches it replaces."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from epserve.kernels.norm import fused_add_rms_norm
from epserve.kernels.router import add_norm_router_ref, topk_softmax

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

H, E, K = 2048, 128, 8


def _inputs(t, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    res = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    gw = (torch.randn(E, H, device="cuda", generator=g) * 0.05).bfloat16()
    return x, res, nw, gw


def _check(got, ref, gw):
    normed, new_res, ids, w = got
    torch.testing.assert_close(new_res, ref[1], rtol=8e-3, atol=0)
    torch.testing.assert_close(normed, ref[0], rtol=8e-3, atol=1e-3)
    logits = F.linear(normed.float(), gw.float())
    tol = 1e-2 * logits.abs().max()
    top = logits.topk(K, dim=1).values[:, -1]
    picked = logits.gather(1, ids)
    assert (picked >= top[:, None] - tol).all(), "a picked expert is not in the top K"
    assert all(len(set(r)) == K for r in ids.tolist()), "an expert picked twice"
    torch.testing.assert_close(w.sum(1), torch.ones(ids.shape[0], device="cuda"))


@pytest.mark.parametrize("t", [1, 7, 64])
def test_matches_reference(t):
    from epserve.kernels.triton.norm_router import add_norm_router_triton

    x, res, nw, gw = _inputs(t, seed=t)
    got = add_norm_router_triton(x, res, nw, 1e-6, gw, K, True)
    _check(got, add_norm_router_ref(x, res, nw, 1e-6, gw, K, True), gw)


def test_graph_replays_repeat():
    from epserve.kernels.triton.norm_router import add_norm_router_triton

    x, res, nw, gw = _inputs(1, seed=3)
    first = add_norm_router_triton(x, res, nw, 1e-6, gw, K, True)  # compiles, makes counters
    _check(first, add_norm_router_ref(x, res, nw, 1e-6, gw, K, True), gw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = add_norm_router_triton(x, res, nw, 1e-6, gw, K, True)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(out, first):
            assert torch.equal(a, b)

    def three_launches():
        normed, _ = fused_add_rms_norm(x, res, nw, 1e-6)
        return topk_softmax(F.linear(normed, gw), K, True)

    us = {}
    for name, fn in (("fused", lambda: add_norm_router_triton(x, res, nw, 1e-6, gw, K, True)),
                     ("three launches", three_launches)):
        fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                fn()
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        us[name] = start.elapsed_time(end) / 200 * 1e3
    print(f"\nadd+norm+router+top-k at T=1 (graph-timed): fused {us['fused']:.1f} us, "
          f"three launches {us['three launches']:.1f} us")
