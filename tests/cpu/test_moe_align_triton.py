"""moe_align (Triton, interpreter on CPU) against moe_align_ref, and the reference's layout itself.

TRITON_INTERPRET=1 is set while the kernel module is imported and, through an autouse fixture,
while each test runs (see test_fused_moe_triton.py for why).
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from interp import import_interpreted  # noqa: E402

mat = import_interpreted("epserve.kernels.moe_align_triton")

import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _ids(t, k, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi, (t, k), generator=g)


def test_ref_layout():
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
    (4, 2, 4, 8, 100, 16),     # nothing local
]


IMPLS = ["moe_align", "moe_align_torch"]  # the one-program kernel, the sync-free torch ops


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}K{}E{}of{}off{}bm{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_static_layout_matches_ref_prefix(case, dtype, impl):
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


@pytest.mark.parametrize("impl", IMPLS)
def test_bound_is_tight_enough_for_worst_routing(impl):
    # every pair on its own expert: each group wastes block_m - 1 slots, the bound holds exactly
    t, k, e, bm = 4, 4, 16, 16
    ids = torch.arange(t * k).reshape(t, k)
    ref_ids, _ = mat.moe_align_ref(ids, e, 0, bm)
    assert ref_ids.numel() == mat.max_aligned_blocks(t * k, e, bm) * bm
    got_ids, got_blocks = getattr(mat, impl)(ids, e, 0, bm)
    assert torch.equal(got_ids, ref_ids) and got_blocks.tolist() == list(range(16))


@pytest.mark.parametrize("impl", IMPLS)
def test_rejects_bad_inputs(impl):
    with pytest.raises(ValueError, match="int32/int64"):
        getattr(mat, impl)(torch.zeros(3, 2), 4, 0, 16)
    with pytest.raises(ValueError, match="power of two"):
        getattr(mat, impl)(torch.zeros(3, 2, dtype=torch.int64), 4, 0, 12)
