"""fused_moe_triton (run in the Triton interpreter on CPU) against fused_moe_ref.

Tolerances: fp32 atol 1e-4 (abs); fp16 max |err| <= 2e-2 * max |ref|.
TRITON_INTERPRET=1 is set while triton and the kernel module are imported (triton.jit picks the
interpreter at decoration time) and, through an autouse fixture, while each test here runs
(triton also reads it at launch); it is restored otherwise, so other test modules in the same
session keep running the torch reference on CPU.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from interp import import_interpreted  # noqa: E402

fmt = import_interpreted("epserve.kernels.fused_moe_triton")

import torch  # noqa: E402

from epserve.kernels.moe import fused_moe, fused_moe_ref  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(t, h, i, e_total, k, dtype, seed, e_local=None):
    g = torch.Generator().manual_seed(seed)
    e_local = e_total if e_local is None else e_local
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e_local, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e_local, h, i, generator=g) / i ** 0.5).to(dtype)
    scores = torch.rand(t, e_total, generator=g)
    topk_weights, topk_ids = torch.topk(torch.softmax(scores, -1), k, dim=-1)
    return x, w13, w2, topk_ids.to(torch.int64), topk_weights.float()


def _check(got, ref, dtype):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if ref.numel() == 0:
        return
    err = (got.float() - ref.float()).abs().max().item()
    if dtype == torch.float32:
        assert err <= 1e-4, err
    else:
        scale = ref.float().abs().max().item()
        assert err <= 2e-2 * max(scale, 1e-6), (err, scale)


# (T, H, I, E, K, block_m)
SHAPES = [
    (1, 32, 16, 4, 2, 16),     # single token
    (20, 32, 16, 8, 2, 16),    # T not a multiple of block_m; some experts get no tokens
    (13, 24, 12, 6, 3, 32),    # H, I not powers of two; block_m > pairs per expert
    (5, 16, 16, 16, 1, 16),    # K=1, most experts empty
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}H{}I{}E{}K{}bm{}".format(*s))
def test_matches_ref(shape, dtype):
    t, h, i, e, k, bm = shape
    x, w13, w2, ids, wts = _inputs(t, h, i, e, k, dtype, seed=t * 31 + h)
    got = fmt.fused_moe_triton(x, w13, w2, ids, wts, block_m=bm)
    _check(got, fused_moe_ref(x, w13, w2, ids, wts), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_expert_offset_shard(dtype):
    # 8 global experts, this shard holds experts 3..5: the rest must contribute zero.
    t, h, i, k = 11, 32, 16, 2
    x, _, _, ids, wts = _inputs(t, h, i, 8, k, dtype, seed=7)
    _, w13, w2, _, _ = _inputs(t, h, i, 8, k, dtype, seed=8, e_local=3)
    local = (ids >= 3) & (ids < 6)
    assert local.any() and (~local).any()
    got = fmt.fused_moe_triton(x, w13, w2, ids, wts, expert_offset=3)
    ref = fused_moe_ref(x, w13, w2, ids, wts, expert_offset=3)
    _check(got, ref, dtype)
    assert torch.all(got[~local.any(1)] == 0)  # tokens with no local expert get exactly zero


def test_no_local_pairs_and_empty():
    x, w13, w2, ids, wts = _inputs(4, 16, 16, 4, 2, torch.float32, seed=1)
    got = fmt.fused_moe_triton(x, w13, w2, ids, wts, expert_offset=100)
    assert got.shape == (4, 16) and torch.all(got == 0)
    got = fmt.fused_moe_triton(x[:0], w13, w2, ids[:0], wts[:0])
    assert got.shape == (0, 16) and got.dtype == torch.float32


def test_int32_ids_and_default_blocks():
    x, w13, w2, ids, wts = _inputs(9, 32, 16, 4, 2, torch.float32, seed=2)
    got = fmt.fused_moe_triton(x, w13, w2, ids.to(torch.int32), wts)
    _check(got, fused_moe_ref(x, w13, w2, ids, wts), torch.float32)


def test_fused_moe_dispatches_under_interpret(monkeypatch):
    x, w13, w2, ids, wts = _inputs(6, 16, 16, 4, 2, torch.float32, seed=3)
    calls = []
    real = fmt.fused_moe_triton
    monkeypatch.setattr(fmt, "fused_moe_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = fused_moe(x, w13, w2, ids, wts)
    assert not calls  # CPU without the interpreter: the reference
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = fused_moe(x, w13, w2, ids, wts)
    assert calls == [1]
    _check(got, ref, torch.float32)


def test_wrapper_rejects_bad_inputs():
    x, w13, w2, ids, wts = _inputs(4, 16, 16, 4, 2, torch.float32, seed=4)
    with pytest.raises(ValueError, match="2-D"):
        fmt.fused_moe_triton(x[None], w13, w2, ids, wts)
    with pytest.raises(ValueError, match="share"):
        fmt.fused_moe_triton(x, w13.half(), w2, ids, wts)
    with pytest.raises(ValueError, match="int64 or int32"):
        fmt.fused_moe_triton(x, w13, w2, ids.float(), wts)
    with pytest.raises(ValueError, match="contiguous"):
        fmt.fused_moe_triton(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, ids, wts)
    with pytest.raises(ValueError, match=r"\[E, 2I, H\]"):
        fmt.fused_moe_triton(x, w13[:, :-1], w2, ids, wts)
    with pytest.raises(ValueError, match="topk_ids"):
        fmt.fused_moe_triton(x, w13, w2, ids[:-1], wts[:-1])


def test_large_batches_align_with_the_torch_layout(monkeypatch):
    # above ALIGN_IN_KERNEL_MAX_PAIRS (prefill) the torch static layout feeds the same GEMMs
    monkeypatch.setattr(fmt, "ALIGN_IN_KERNEL_MAX_PAIRS", 8)
    calls = []
    real = fmt.moe_align_torch
    monkeypatch.setattr(fmt, "moe_align_torch", lambda *a: calls.append(1) or real(*a))
    for dtype in (torch.float32, torch.float16):
        x, w13, w2, ids, wts = _inputs(20, 32, 16, 8, 2, dtype, seed=11)
        _check(fmt.fused_moe_triton(x, w13, w2, ids, wts), fused_moe_ref(x, w13, w2, ids, wts),
               dtype)
        x, _, _, ids, wts = _inputs(11, 32, 16, 8, 2, dtype, seed=12)
        _, w13, w2, _, _ = _inputs(11, 32, 16, 8, 2, dtype, seed=13, e_local=3)
        _check(fmt.fused_moe_triton(x, w13, w2, ids, wts, expert_offset=3),
               fused_moe_ref(x, w13, w2, ids, wts, expert_offset=3), dtype)
    assert len(calls) == 4


def test_few_pairs_skip_the_layout(monkeypatch):
    # up to PAIR_BLOCKS_MAX_PAIRS (batch-1/2 decode) no layout is built: each pair is a block
    def no_align(*a):
        raise AssertionError("moe_align called for a few pairs")

    monkeypatch.setattr(fmt, "moe_align", no_align)
    monkeypatch.setattr(fmt, "moe_align_torch", no_align)
    assert fmt.PAIR_BLOCKS_MAX_PAIRS >= 8
    for dtype in (torch.float32, torch.float16):
        x, w13, w2, ids, wts = _inputs(2, 32, 16, 6, 4, dtype, seed=21)  # tokens share experts
        assert len(set(ids[0].tolist()) & set(ids[1].tolist())) >= 2
        _check(fmt.fused_moe_triton(x, w13, w2, ids, wts), fused_moe_ref(x, w13, w2, ids, wts),
               dtype)
        x, _, _, ids, wts = _inputs(2, 32, 16, 8, 4, dtype, seed=22)
        _, w13, w2, _, _ = _inputs(2, 32, 16, 8, 4, dtype, seed=23, e_local=3)
        local = (ids >= 3) & (ids < 6)
        assert local.any() and (~local).any()
        _check(fmt.fused_moe_triton(x, w13, w2, ids, wts, expert_offset=3),
               fused_moe_ref(x, w13, w2, ids, wts, expert_offset=3), dtype)


@pytest.mark.parametrize("shape", SHAPES[:1] + SHAPES[3:], ids=["T1", "T5K1"])
def test_few_pairs_through_the_layout(shape, monkeypatch):
    # the layout path stays correct for the smallest batches too (other top-k / thresholds)
    monkeypatch.setattr(fmt, "PAIR_BLOCKS_MAX_PAIRS", 0)
    t, h, i, e, k, bm = shape
    x, w13, w2, ids, wts = _inputs(t, h, i, e, k, torch.float32, seed=t * 31 + h)
    _check(fmt.fused_moe_triton(x, w13, w2, ids, wts, block_m=bm),
           fused_moe_ref(x, w13, w2, ids, wts), torch.float32)
