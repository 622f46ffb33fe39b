"""The one-row Triton GEMV on CUDA at the Qwen3-30B-A3B attention projections (bf16): agrees
with float32 ``linear_ref`` as closely as cuBLAS does, and captures in a CUDA graph."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from epserve.kernels.linear import linear, linear_ref

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (100, 300)])
def test_bf16_as_close_as_cublas(n, k):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    exact = x.float() @ w.float().t()
    got, cublas = linear(x, w), F.linear(x, w)
    err, err_cublas = (got.float() - exact).abs().max(), (cublas.float() - exact).abs().max()
    assert err <= 2 * err_cublas + 1e-3, (err.item(), err_cublas.item())
    torch.testing.assert_close(got, linear_ref(x, w), rtol=2e-2, atol=2e-2)


def test_graph_capture_replays():
    x = torch.randn(1, 2048, device="cuda").bfloat16()
    w = torch.randn(512, 2048, device="cuda").bfloat16()
    first = linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, linear(x, w)) and not torch.equal(out, first)
