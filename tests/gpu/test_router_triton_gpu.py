"""topk_softmax_triton on CUDA against topk_softmax_ref at a Qwen3-30B-A3B-like router (E=128,
K=8, bf16 logits): ids equal, weights within 1e-5; CUDA-graph capture and replay; prints
microseconds per call for the kernel, the reference and today's softmax/topk/renormalise.

Logits are multiples of 1/256 (exact ties allowed): the kernel's exp is not bitwise torch's, so
fp32 logits a few ulps apart may legitimately rank differently; 1/256 apart they cannot."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpu_timing import cuda_ms

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

E, K = 128, 8


def _logits(t, seed, e=E, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, e, device="cuda", generator=g) * 2
    return (torch.round(x * 256) / 256).to(dtype)


def _check(got, ref):
    assert got[0].dtype == torch.int64 and got[1].dtype == torch.float32
    assert got[0].is_cuda and got[0].shape == ref[0].shape
    mismatch = (got[0] != ref[0]).any(1).sum().item()
    assert mismatch == 0, f"{mismatch} rows pick different experts"
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


def _today(logits, k, renorm):
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def _time_us(fn, iters=200):
    return 1e3 * cuda_ms(fn, iters, warmup=5)


@pytest.mark.parametrize("renorm", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("t", [1, 256, 4096])
def test_bf16_matches_ref(t, renorm):
    from epserve.kernels.router import topk_softmax, topk_softmax_ref
    from epserve.kernels.triton.router import topk_softmax_triton

    logits = _logits(t, seed=t)
    ref = topk_softmax_ref(logits, K, renorm)
    _check(topk_softmax_triton(logits, K, renorm), ref)
    _check(topk_softmax(logits, K, renorm), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("e,k", [(60, 4), (512, 8)])
def test_other_dtypes_and_widths(dtype, e, k):
    from epserve.kernels.router import topk_softmax_ref
    from epserve.kernels.triton.router import topk_softmax_triton

    logits = _logits(300, seed=e, e=e, dtype=dtype)
    _check(topk_softmax_triton(logits, k, True), topk_softmax_ref(logits, k, True))


def test_exact_ties_bf16():
    from epserve.kernels.router import topk_softmax_ref
    from epserve.kernels.triton.router import topk_softmax_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randint(-2, 3, (512, E), device="cuda", generator=g).bfloat16()
    _check(topk_softmax_triton(logits, K, True), topk_softmax_ref(logits, K, True))


def test_cuda_graph_capture_and_replay():
    from epserve.kernels.router import topk_softmax, topk_softmax_ref

    static = _logits(64, seed=5)
    topk_softmax(static, K, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = topk_softmax(static, K, True)
    for seed in (6, 7):
        static.copy_(_logits(64, seed=seed))
        graph.replay()
        _check((ids, weights), topk_softmax_ref(static, K, True))


@pytest.mark.parametrize("t", [1, 256, 4096])
def test_timing(t):
    from epserve.kernels.router import topk_softmax_ref
    from epserve.kernels.triton.router import topk_softmax_triton

    logits = _logits(t, seed=100 + t)
    _check(topk_softmax_triton(logits, K, True), topk_softmax_ref(logits, K, True))
    tri = _time_us(lambda: topk_softmax_triton(logits, K, True))
    ref = _time_us(lambda: topk_softmax_ref(logits, K, True))
    today = _time_us(lambda: _today(logits, K, True))
    print(f"topk_softmax T={t} E={E} K={K} bf16: triton {tri:.1f} us, ref {ref:.1f} us, "
          f"today's topk path {today:.1f} us")
