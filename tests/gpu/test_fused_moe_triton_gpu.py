"""fused_moe_triton in bf16 on CUDA against fused_moe_ref in fp32 at a Qwen3-30B-A3B-like layer
(H=2048, I=768, E=128, K=8); bar: max |err| / max |ref| < 2e-2. Prints a small timing."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpu_timing import cuda_ms

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

H, I, E, K = 2048, 768, 128, 8


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5
    return w13.bfloat16(), w2.bfloat16()


def _route(t, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    probs = torch.softmax(torch.randn(t, E, device="cuda", generator=g), -1)
    wts, ids = torch.topk(probs, K, dim=-1)
    return x, ids.to(torch.int64), (wts / wts.sum(-1, keepdim=True)).float()


def _time_ms(fn, iters=20):
    return cuda_ms(fn, iters)


@pytest.mark.parametrize("t", [1, 2, 8, 256, 8192])  # pair blocks, layout, torch layout
def test_bf16_matches_fp32_ref(weights, t):
    from epserve.kernels.triton.fused_moe import fused_moe_triton
    from epserve.kernels.moe import fused_moe_ref

    w13, w2 = weights
    x, ids, wts = _route(t, seed=t)
    got = fused_moe_triton(x, w13, w2, ids, wts)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), ids, wts)
    assert got.dtype == torch.bfloat16 and got.shape == (t, H)
    rel = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    print(f"T={t}: max|err|/max|ref| = {rel:.2e}")
    assert rel < 2e-2


def test_expert_offset_shard_bf16(weights):
    from epserve.kernels.triton.fused_moe import fused_moe_triton
    from epserve.kernels.moe import fused_moe_ref

    w13, w2 = weights
    x, ids, wts = _route(64, seed=9)
    lo, hi = 32, 96  # this shard holds global experts 32..95
    got = fused_moe_triton(x, w13[lo:hi], w2[lo:hi], ids, wts, expert_offset=lo)
    ref = fused_moe_ref(x.float(), w13[lo:hi].float(), w2[lo:hi].float(), ids, wts,
                        expert_offset=lo)
    rel = ((got.float() - ref).abs().max() / ref.abs().max()).item()
    assert rel < 2e-2


@pytest.mark.parametrize("t", [1, 256])
def test_timing(weights, t):
    from epserve.kernels.moe import fused_moe_ref
    from epserve.kernels.triton.fused_moe import fused_moe_triton

    w13, w2 = weights
    x, ids, wts = _route(t, seed=100 + t)
    got = fused_moe_triton(x, w13, w2, ids, wts)  # what is timed is correct
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), ids, wts)
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < 2e-2
    tri = _time_ms(lambda: fused_moe_triton(x, w13, w2, ids, wts))
    ref = _time_ms(lambda: fused_moe_ref(x, w13, w2, ids, wts))
    print(f"fused_moe T={t} bf16: triton {tri:.3f} ms, ref {ref:.3f} ms, speedup {ref / tri:.1f}x")


@pytest.mark.parametrize("t", [1, 256, 8192])  # pair blocks, in-kernel layout, torch layout
def test_no_host_sync(weights, t):
    import warnings

    from epserve.kernels.triton.fused_moe import fused_moe_triton

    w13, w2 = weights
    x, ids, wts = _route(t, seed=300 + t)
    fused_moe_triton(x, w13, w2, ids, wts)  # compile, warm the allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fused_moe_triton(x, w13, w2, ids, wts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert not syncs, syncs


@pytest.mark.parametrize("t,e,off,bm", [(3, 128, 0, 16), (256, 128, 0, 32), (512, 128, 0, 64),
                                        (256, 64, 64, 32), (500, 60, 0, 16)])
def test_align_layout_on_cuda_is_the_reference(t, e, off, bm):
    # the chunk programs run at once on the GPU (one at a time under the interpreter): the
    # layout must not depend on their order; T=256 at block_m 32 is the short workload's decode
    from epserve.kernels.triton.moe_align import max_aligned_blocks, moe_align, moe_align_ref

    g = torch.Generator(device="cuda").manual_seed(t + e)
    ids = torch.randint(0, 128, (t, K), device="cuda", generator=g)
    want_ids, want_blocks = moe_align_ref(ids, e, off, bm)
    for _ in range(3):
        got_ids, got_blocks = moe_align(ids, e, off, bm)
        nb, n = max_aligned_blocks(t * K, e, bm), want_blocks.numel()
        assert got_ids.shape == (nb * bm,) and got_blocks.shape == (nb,)
        assert torch.equal(got_blocks[:n], want_blocks) and torch.equal(got_ids[:n * bm], want_ids)
        assert torch.all(got_blocks[n:] == -1) and torch.all(got_ids[n * bm:] == t * K)
