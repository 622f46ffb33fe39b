"""Paged KV writes: the public entry on both paths, and the Triton kernel (interpreter on CPU)
against ``write_kv_ref``.

KV writes are copies and must be exact (except fp32 -> bf16 caches: the interpreter truncates
where the GPU rounds to nearest even, so one bf16 ulp there).
"""

from __future__ import annotations

import pytest
import torch
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

from epserve.kernels.kv_write import write_kv, write_kv_ref

_NAMES = ("kv_write",)
_MODS = interpreted_modules(*_NAMES)
kvt, = _MODS
assert kvt is None or kvt.INTERPRETED
interpret, path = kernel_fixtures(_NAMES, _MODS)


def _kv_case(t, hkv, d, nb, bs, dtype, cache_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(t, 3 * hkv * d, generator=g).to(dtype)  # k, v as strided views
    k = kv[:, hkv * d:2 * hkv * d].view(t, hkv, d)
    v = kv[:, 2 * hkv * d:].view(t, hkv, d)
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    return k, v, k_cache, v_cache, slots


def test_write_kv_writes_slots_and_skips_padding(path):
    k_cache, v_cache = torch.zeros(6, 4, 2, 3), torch.zeros(6, 4, 2, 3)
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    write_kv(k, v, k_cache, v_cache, torch.tensor([13, -1, 2]))
    torch.testing.assert_close(k_cache[3, 1], k[0])
    torch.testing.assert_close(v_cache[0, 2], v[2])
    assert int((k_cache.abs().sum(-1).sum(-1) > 0).sum()) == 2  # the -1 row wrote nothing


@needs_triton
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32),
                                               (torch.float16, torch.float16),
                                               (torch.float32, torch.float16),
                                               (torch.float32, torch.bfloat16)],
                         ids=["fp32", "fp16", "fp32->fp16", "fp32->bf16"])
@pytest.mark.parametrize("shape", [(1, 2, 16), (6, 3, 24), (5, 1, 8)],
                         ids=lambda s: "T{}Hkv{}D{}".format(*s))
def test_write_kv_matches_ref(shape, dtype, cache_dtype, interpret):
    t, hkv, d = shape
    k, v, kc, vc, slots = _kv_case(t, hkv, d, 4, 4, dtype, cache_dtype, seed=t + d)
    slots[t // 2] = -1  # a padded row
    ref_kc, ref_vc = kc.clone(), vc.clone()
    write_kv_ref(k, v, ref_kc, ref_vc, slots)
    kvt.write_kv_triton(k, v, kc, vc, slots)
    if cache_dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even): one bf16 ulp.
        torch.testing.assert_close(kc, ref_kc, rtol=1e-2, atol=1e-6)
        torch.testing.assert_close(vc, ref_vc, rtol=1e-2, atol=1e-6)
        untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool)
        untouched[slots[slots >= 0]] = False
        assert torch.equal(kc.view(-1, hkv, d)[untouched], ref_kc.view(-1, hkv, d)[untouched])
    else:
        assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


@needs_triton
def test_write_kv_padding_rows_untouched_public_entry(interpret):
    k, v, kc, vc, slots = _kv_case(4, 2, 8, 3, 4, torch.float32, torch.float32, seed=21)
    slots = torch.tensor([5, -1, 0, -1])
    kc0, vc0 = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, slots.int())
    flat_k, flat_v = kc.view(12, 2, 8), vc.view(12, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_v[0], v[2])
    untouched = [s for s in range(12) if s not in (5, 0)]
    assert torch.equal(flat_k[untouched], kc0.view(12, 2, 8)[untouched])
    assert torch.equal(flat_v[untouched], vc0.view(12, 2, 8)[untouched])
    all_pad = torch.full((4,), -1)
    write_kv(k, v, kc, vc, all_pad)
    assert torch.equal(kc.view(12, 2, 8)[untouched], kc0.view(12, 2, 8)[untouched])


@needs_triton
def test_write_kv_errors(interpret):
    k, v, kc, vc, slots = _kv_case(2, 2, 8, 2, 4, torch.float32, torch.float32, seed=22)
    with pytest.raises(ValueError, match="must both be"):
        kvt.write_kv_triton(k, v[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match="caches"):
        kvt.write_kv_triton(k, v, kc[:, :, :1], vc[:, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kvt.write_kv_triton(k, v, kc, vc, slots.float())
    with pytest.raises(ValueError, match="dtypes"):
        kvt.write_kv_triton(k, v, kc.double(), vc.double(), slots)
    with pytest.raises(ValueError, match="contiguous last dim"):
        kvt.write_kv_triton(k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, vc, slots)
    kvt.write_kv_triton(k[:0], v[:0], kc, vc, slots[:0])  # empty: no launch, no error
