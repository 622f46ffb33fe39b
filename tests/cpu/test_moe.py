"""The fused MoE op: ``fused_moe_ref`` against a per-token loop (the public entry on both
paths), the Triton pipeline (interpreter on CPU) against ``fused_moe_ref``, its pair rows
before the combine (``fused_moe_pairs``, ``combine_pairs``: the combine kernel is its torch
reference bit for bit), and its layout step ``moe_align`` (Triton) / ``moe_align_torch``
against ``moe_align_ref``.

Tolerances of the Triton pipeline: fp32 atol 1e-4 (abs); fp16 max |err| <= 2e-2 * max |ref|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

from epserve.kernels.moe import (RoutedPairs, combine_pairs, combine_pairs_ref, fused_moe,
                                fused_moe_pairs, fused_moe_ref)

_NAMES = ("fused_moe", "moe_align")
_MODS = interpreted_modules(*_NAMES)
fmt, mat = _MODS
assert mat is None or fmt.moe_align is mat.moe_align  # the pipeline runs these copies
interpret, path = kernel_fixtures(_NAMES, _MODS)


# --------------------------------------------------------------------------- the reference


def _moe_case(t=13, h=16, inter=8, e=8, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.3
    w2 = torch.randn(e, h, inter, generator=g) * 0.3
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    return x, w13, w2, ids, weights


def test_fused_moe_matches_per_token_loop(path):
    x, w13, w2, ids, weights = _moe_case()
    inter = w2.shape[2]
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            ref[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(fused_moe(x, w13, w2, ids, weights), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shards", [2, 4])
def test_fused_moe_expert_shards_sum_to_full(shards, path):
    x, w13, w2, ids, weights = _moe_case(seed=1)
    full = fused_moe_ref(x, w13, w2, ids, weights)
    per = w13.shape[0] // shards
    parts = [fused_moe(x, w13[r * per:(r + 1) * per], w2[r * per:(r + 1) * per], ids, weights,
                       expert_offset=r * per) for r in range(shards)]
    assert all(p.abs().sum() > 0 for p in parts)
    torch.testing.assert_close(sum(parts), full, atol=1e-5, rtol=1e-5)


def test_fused_moe_ids_outside_the_shard_contribute_nothing(path):
    x, w13, w2, _, weights = _moe_case()
    ids = torch.full((x.shape[0], 2), 100)
    assert torch.equal(fused_moe(x, w13, w2, ids, weights), torch.zeros_like(x))


def test_fused_moe_rejects_bad_shapes(path):
    x, w13, w2, ids, weights = _moe_case()
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :-1], ids, weights)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, ids[:-1], weights)


@pytest.mark.parametrize("t", [1, 13])  # 1: a block per pair; 13: through the layout
def test_fused_moe_pairs_combine_to_fused_moe(path, t):
    """On the Triton path the pair rows (a shard's: its local ones), whose combine is
    ``fused_moe``'s output bit for bit; elsewhere ``fused_moe_ref``'s output itself."""
    x, w13, w2, ids, weights = _moe_case(t=t, seed=2)
    for lo, hi in ((0, 8), (3, 6)):
        got = fused_moe_pairs(x, w13[lo:hi], w2[lo:hi], ids, weights, expert_offset=lo)
        want = fused_moe(x, w13[lo:hi], w2[lo:hi], ids, weights, expert_offset=lo)
        assert isinstance(got, RoutedPairs) == (path == "interpreter")
        if path == "interpreter":
            assert (got.y.shape, got.expert_offset, got.num_local) == ((t * 2, 16), lo, hi - lo)
            got = combine_pairs(got)
        assert torch.equal(got, want)
        torch.testing.assert_close(got, fused_moe_ref(x, w13[lo:hi], w2[lo:hi], ids, weights,
                                                      expert_offset=lo), atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_combine_kernel_is_its_reference(dtype, interpret):
    """The combine's launch against ``combine_pairs_ref``: the same float32 sums (bf16: the
    interpreter rounds the sum to bf16 by truncation, torch to nearest: one ulp); the pairs
    of other shards' experts are never read (NaN rows here)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 9, (6, 4), generator=g, dtype=torch.int32)
    pairs = RoutedPairs(torch.randn(24, 40, generator=g).to(dtype), ids, 2, 5)
    local = ((ids >= 2) & (ids < 7)).reshape(-1)
    assert local.any() and not local.all()
    pairs.y[~local] = float("nan")
    got = fmt.combine_pairs_triton(pairs.y, ids, 2, 5)
    want = combine_pairs_ref(pairs)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want)
    assert torch.equal(combine_pairs(pairs), got)


# --------------------------------------------------------------------------- the Triton pipeline


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


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}H{}I{}E{}K{}bm{}".format(*s))
def test_matches_ref(shape, dtype, interpret):
    t, h, i, e, k, bm = shape
    x, w13, w2, ids, wts = _inputs(t, h, i, e, k, dtype, seed=t * 31 + h)
    got = fmt.fused_moe_triton(x, w13, w2, ids, wts, block_m=bm)
    _check(got, fused_moe_ref(x, w13, w2, ids, wts), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_expert_offset_shard(dtype, interpret):
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


@needs_triton
def test_no_local_pairs_and_empty(interpret):
    x, w13, w2, ids, wts = _inputs(4, 16, 16, 4, 2, torch.float32, seed=1)
    got = fmt.fused_moe_triton(x, w13, w2, ids, wts, expert_offset=100)
    assert got.shape == (4, 16) and torch.all(got == 0)
    got = fmt.fused_moe_triton(x[:0], w13, w2, ids[:0], wts[:0])
    assert got.shape == (0, 16) and got.dtype == torch.float32


@needs_triton
def test_int32_ids_and_default_blocks(interpret):
    x, w13, w2, ids, wts = _inputs(9, 32, 16, 4, 2, torch.float32, seed=2)
    got = fmt.fused_moe_triton(x, w13, w2, ids.to(torch.int32), wts)
    _check(got, fused_moe_ref(x, w13, w2, ids, wts), torch.float32)


@needs_triton
def test_fused_moe_dispatches_under_interpret(monkeypatch, interpret):
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


@needs_triton
def test_wrapper_rejects_bad_inputs(interpret):
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


@needs_triton
def test_large_batches_align_with_the_torch_layout(monkeypatch, interpret):
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


@needs_triton
def test_few_pairs_skip_the_layout(monkeypatch, interpret):
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


@needs_triton
@pytest.mark.parametrize("shape", SHAPES[:1] + SHAPES[3:], ids=["T1", "T5K1"])
def test_few_pairs_through_the_layout(shape, monkeypatch, interpret):
    # the layout path stays correct for the smallest batches too (other top-k / thresholds)
    monkeypatch.setattr(fmt, "PAIR_BLOCKS_MAX_PAIRS", 0)
    t, h, i, e, k, bm = shape
    x, w13, w2, ids, wts = _inputs(t, h, i, e, k, torch.float32, seed=t * 31 + h)
    _check(fmt.fused_moe_triton(x, w13, w2, ids, wts, block_m=bm),
           fused_moe_ref(x, w13, w2, ids, wts), torch.float32)


# --------------------------------------------------------------------------- the layout (moe_align)


def _ids(t, k, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi, (t, k), generator=g)


@needs_triton
def test_align_ref_layout(interpret):
    t, k, e, off, bm = 10, 3, 5, 2, 16
    ids = _ids(t, k, 9, 5)
    sorted_ids, block_expert = mat.moe_align_ref(ids, e, off, bm)
    flat = ids.reshape(-1) - off
    local = torch.nonzero((flat >= 0) & (flat < e)).reshape(-1)
    assert sorted_ids.dtype == torch.int32 and block_expert.dtype == torch.int32
    assert sorted_ids.numel() % bm == 0 and block_expert.numel() == sorted_ids.numel() // bm
    real = sorted_ids[sorted_ids != t * k].long()
    assert sorted(real.tolist()) == local.tolist()  # every local pair exactly once, no others
    for b, ex in enumerate(block_expert.tolist()):
        blk = sorted_ids[b * bm:(b + 1) * bm].long()
        pairs = blk[blk != t * k]
        assert ex >= 0 and pairs.numel() > 0 and torch.all(flat[pairs] == ex)
        assert torch.all(blk[:pairs.numel()] == pairs)  # real pairs first, ascending
        assert pairs.tolist() == sorted(pairs.tolist())
    s2, b2 = mat.moe_align_ref(ids, e, 100, bm)  # nothing local -> empty layout
    assert s2.numel() == 0 and b2.numel() == 0


# (T, K, E_local, E_total, offset, block_m)
CASES = [
    (700, 8, 128, 128, 0, 64),  # prefill-like: many pairs per expert
    (1, 8, 128, 128, 0, 16),   # decode, one token: 8 experts hit, most of the buffer unused
    (10, 3, 5, 9, 2, 16),      # a shard: some pairs belong to other ranks
    (64, 8, 60, 60, 0, 16),    # E not a power of two
    (37, 2, 8, 8, 0, 64),      # big blocks, uneven groups
    (300, 8, 16, 16, 0, 32),   # many chunks per expert
    (600, 8, 64, 128, 64, 32),  # a shard over 38 chunks: counts summed across programs
    (4, 2, 4, 8, 100, 16),     # nothing local
]


IMPLS = ["moe_align", "moe_align_torch"]  # the chunked Triton kernels, the sync-free torch ops


@needs_triton
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}K{}E{}of{}off{}bm{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_align_static_layout_matches_ref_prefix(case, dtype, impl, interpret):
    t, k, e, e_total, off, bm = case
    ids = _ids(t, k, e_total + off, seed=t * 7 + k).to(dtype)
    ref_ids, ref_blocks = mat.moe_align_ref(ids, e, off, bm)
    got_ids, got_blocks = getattr(mat, impl)(ids, e, off, bm)
    nb = mat.max_aligned_blocks(t * k, e, bm)
    assert got_ids.shape == (nb * bm,) and got_blocks.shape == (nb,)  # static: routing-free size
    n = ref_blocks.numel()
    assert torch.equal(got_blocks[:n], ref_blocks)
    assert torch.equal(got_ids[:n * bm], ref_ids)
    assert torch.all(got_blocks[n:] == -1) and torch.all(got_ids[n * bm:] == t * k)


@needs_triton
@pytest.mark.parametrize("impl", IMPLS)
def test_align_bound_is_tight_enough_for_worst_routing(impl, interpret):
    # every pair on its own expert: each group wastes block_m - 1 slots, the bound holds exactly
    t, k, e, bm = 4, 4, 16, 16
    ids = torch.arange(t * k).reshape(t, k)
    ref_ids, _ = mat.moe_align_ref(ids, e, 0, bm)
    assert ref_ids.numel() == mat.max_aligned_blocks(t * k, e, bm) * bm
    got_ids, got_blocks = getattr(mat, impl)(ids, e, 0, bm)
    assert torch.equal(got_ids, ref_ids) and got_blocks.tolist() == list(range(16))


@needs_triton
@pytest.mark.parametrize("impl", IMPLS)
def test_align_rejects_bad_inputs(impl, interpret):
    with pytest.raises(ValueError, match="int32/int64"):
        getattr(mat, impl)(torch.zeros(3, 2), 4, 0, 16)
    with pytest.raises(ValueError, match="power of two"):
        getattr(mat, impl)(torch.zeros(3, 2, dtype=torch.int64), 4, 0, 12)
