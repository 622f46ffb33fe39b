"""Paged attention: the reference against a dense causal computation (the public entry on both
paths), the metadata's checks, and the Triton decode kernel (interpreter on CPU) against
``paged_attention_ref`` with the entry's choice of kernel. The prefill kernel's tests are in
test_attention_prefill.py.

Decode kernel: random caches and random non-contiguous block tables; fp32 to 1e-4 and fp16 to
2e-3 (max abs).
"""

from __future__ import annotations

import pytest
import torch
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton
from paged_case import paged_kv

from epserve.kernels import attention
from epserve.kernels.attention import AttentionMetadata, paged_attention, paged_attention_ref
from epserve.kernels.kv_write import write_kv

_NAMES = ("paged_attention", "paged_prefill", "kv_write")
_MODS = interpreted_modules(*_NAMES)
pdt, _, _ = _MODS
assert pdt is None or pdt.INTERPRETED
interpret, path = kernel_fixtures(_NAMES, _MODS)

ATOL = {torch.float32: 1e-4, torch.float16: 2e-3}


# --------------------------------------------------------------------------- the reference


def _dense_causal(q, k, v, scale, window=None):
    """q: [n, Hq, D] (last n of L positions), k, v: [L, Hkv, D] -> [n, Hq, D], one sequence."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    out = torch.empty_like(q)
    for i in range(n):
        p = length - n + i
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,lhd->hl", q[i], k[lo:p + 1]) * scale
        out[i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), v[lo:p + 1])
    return out


def _paged_case(seq_lens, new_lens, hq=4, hkv=2, d=8, block_size=4, num_blocks=40, seed=0, pad=0):
    """Random K/V for whole sequences written into shuffled blocks; q for their last tokens."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)  # garbage outside slots
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    ks, vs, qs, slots, qsl = [], [], [], [], [0]
    for s, (length, n) in enumerate(zip(seq_lens, new_lens)):
        blocks = [perm.pop() for _ in range(-(-length // block_size))]
        tables[s, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k, v = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, d, generator=g)
        for pos in range(length - n):  # the earlier tokens are already cached
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(length - n, length)]
        ks.append(k), vs.append(v), qs.append(torch.randn(n, hq, d, generator=g))
        qsl.append(qsl[-1] + n)
    new_k = torch.cat([k[len(k) - n:] for k, n in zip(ks, new_lens)] + [torch.randn(pad, hkv, d)])
    new_v = torch.cat([v[len(v) - n:] for v, n in zip(vs, new_lens)] + [torch.randn(pad, hkv, d)])
    q = torch.cat(qs + [torch.randn(pad, hq, d)])
    meta = AttentionMetadata(torch.tensor(slots + [-1] * pad, dtype=torch.int64), tuple(qsl),
                             tuple(seq_lens), tables, block_size)
    return q, new_k, new_v, k_cache, v_cache, meta, (ks, vs, qs)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_paged_attention_matches_dense_causal(window, hkv, path):
    seq_lens, new_lens = [9, 14, 3, 6], [9, 5, 1, 2]  # a prefill, a chunk, decodes
    q, k, v, k_cache, v_cache, meta, (ks, vs, qs) = _paged_case(seq_lens, new_lens, hkv=hkv, pad=2)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = 8 ** -0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale, sliding_window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    for s in range(len(seq_lens)):
        a, b = meta.query_start_loc[s], meta.query_start_loc[s + 1]
        ref = _dense_causal(qs[s], ks[s], vs[s], scale, window)
        torch.testing.assert_close(out[a:b], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[meta.query_start_loc[-1]:], torch.zeros_like(out[meta.query_start_loc[-1]:]))


def test_paged_attention_half_precision_returns_query_dtype(path):
    q, k, v, k_cache, v_cache, meta, _ = _paged_case([7, 5], [7, 1])
    q16, kc, vc = q.half(), k_cache.half(), v_cache.half()
    write_kv(k.half(), v.half(), kc, vc, meta.slot_mapping)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(q16, kc, vc, meta, 0.3)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), paged_attention(q, k_cache, v_cache, meta, 0.3),
                               atol=5e-3, rtol=5e-3)


def test_metadata_rejects_inconsistent_lengths():
    with pytest.raises(ValueError, match="query_start_loc"):
        AttentionMetadata(torch.zeros(3, dtype=torch.int64), (0, 3), (3, 1),
                          torch.zeros(2, 1, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="new rows"):
        AttentionMetadata(torch.zeros(3, dtype=torch.int64), (0, 3), (2,),
                          torch.zeros(1, 1, dtype=torch.int32), 4).validate()


# --------------------------------------------------------------------------- the decode kernel


def _case(seed: int, s: int, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype,
          lens: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = [1] + [int(x) for x in torch.randint(2, 6 * bs + 3, (s - 1,), generator=g)]
    k_cache, v_cache, tables = paged_kv(g, lens, hkv, d, bs, dtype)
    q = torch.randn(s, hq, d, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.full((s,), -1, dtype=torch.long),
                             query_start_loc=tuple(range(s + 1)), seq_lens=tuple(lens),
                             block_tables=tables, block_size=bs)
    return q, k_cache, v_cache, meta


def _kernel(q, k_cache, v_cache, meta, scale, window=None):
    sl = torch.tensor(meta.seq_lens, dtype=torch.int32)
    return pdt.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, sl, scale,
                                      window)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bs", [4, 8])
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
def test_decode_kernel_matches_ref(hq, hkv, d, bs, dtype, interpret):
    seed = hq * 1000 + hkv * 100 + d * 10 + bs + (dtype == torch.float16)
    s = 1 + seed % 5
    q, k_cache, v_cache, meta = _case(seed, s, hq, hkv, d, bs, dtype)
    scale = d ** -0.5
    out = _kernel(q, k_cache, v_cache, meta, scale)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype and out.shape == ref.shape
    assert ref.abs().max() > 0.1  # the comparison is not vacuous
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("window", [1, 5, 16, 1000])
def test_decode_kernel_sliding_window(window, dtype, interpret):
    # Lengths below, at and past the window; BLOCK_N=16 tiles start before the window's edge.
    q, k_cache, v_cache, meta = _case(7, 5, 8, 2, 32, 4, dtype, lens=[1, 5, 17, 30, 41])
    out = _kernel(q, k_cache, v_cache, meta, 0.2, window)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.2, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    if window < 30:  # the window changes the answer, so it is really applied
        full = paged_attention_ref(q, k_cache, v_cache, meta, 0.2)
        assert (full.float() - ref.float()).abs().max() > 1e-2


@needs_triton
def test_dispatch_uses_kernel_for_pure_decode(monkeypatch, interpret):
    # paged_attention imports the kernel module lazily, from sys.modules: the interpreted copy
    # (the fixture), whatever imported it before (in compiled mode, with no GPU driver).
    q, k_cache, v_cache, meta = _case(11, 4, 8, 2, 16, 8, torch.float32)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    calls = []

    def no_ref(*args, **kwargs):
        calls.append(1)
        raise AssertionError("paged_attention fell back to the reference on a pure decode batch")

    monkeypatch.setattr(attention, "paged_attention_ref", no_ref)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert not calls
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@needs_triton
def test_dispatch_keeps_ref_for_prefill(monkeypatch, interpret):
    q, k_cache, v_cache, meta = _case(12, 2, 4, 2, 16, 4, torch.float32, lens=[5, 9])
    q = torch.randn(5, 4, 16)
    meta = AttentionMetadata(slot_mapping=torch.full((5,), -1, dtype=torch.long),
                             query_start_loc=(0, 2, 5), seq_lens=meta.seq_lens,
                             block_tables=meta.block_tables, block_size=4)
    def no_kernel(*args, **kwargs):
        raise AssertionError("the decode kernel ran on a prefill batch")

    monkeypatch.setattr(pdt, "paged_decode_attention", no_kernel)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.25))


@needs_triton
def test_wrapper_rejects_bad_inputs(interpret):
    q, k_cache, v_cache, meta = _case(13, 2, 4, 2, 16, 4, torch.float32, lens=[3, 6])
    sl = torch.tensor(meta.seq_lens, dtype=torch.int32)
    bt = meta.block_tables
    with pytest.raises(ValueError, match="multiple"):
        pdt.paged_decode_attention(torch.randn(2, 3, 16), k_cache, v_cache, bt, sl, 1.0)
    with pytest.raises(ValueError, match="dtypes"):
        pdt.paged_decode_attention(q.half(), k_cache, v_cache, bt, sl, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        kt = k_cache.transpose(0, 1).contiguous().transpose(0, 1)
        pdt.paged_decode_attention(q, kt, v_cache, bt, sl, 1.0)
    with pytest.raises(ValueError, match="int32"):
        pdt.paged_decode_attention(q, k_cache, v_cache, bt.long(), sl, 1.0)
    with pytest.raises(ValueError, match="seq_lens_t"):
        pdt.paged_decode_attention(q, k_cache, v_cache, bt, sl[:1], 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        pdt.paged_decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, bt, sl, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        pdt.paged_decode_attention(q, k_cache, v_cache, bt, sl, 1.0, sliding_window=0)


@needs_triton
def test_head_dim_not_power_of_two(interpret):
    q, k_cache, v_cache, meta = _case(14, 3, 4, 2, 24, 4, torch.float32, lens=[1, 6, 11])
    out = _kernel(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.2),
                               atol=1e-4, rtol=0)
