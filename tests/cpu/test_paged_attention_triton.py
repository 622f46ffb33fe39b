"""Triton paged decode attention under TRITON_INTERPRET=1 equals ``paged_attention_ref``.

Random caches and random non-contiguous block tables; fp32 to 1e-4 and fp16 to 2e-3 (max abs).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# triton.jit reads TRITON_INTERPRET when a kernel is defined, so set it around the imports below;
# restore it afterwards so later test modules (engine parity) keep the torch reference path, and
# drop the interpreted module from sys.modules so a later CUDA import compiles it for real.
_PREV_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton")
    sys.modules.pop("epserve.kernels.paged_attention_triton", None)
    from epserve.kernels.paged_attention_triton import _paged_decode_kernel, paged_decode_attention
finally:
    if _PREV_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREV_INTERPRET
    sys.modules.pop("epserve.kernels.paged_attention_triton", None)

from epserve.kernels import attention  # noqa: E402
from epserve.kernels.attention import AttentionMetadata, paged_attention, paged_attention_ref  # noqa: E402

assert type(_paged_decode_kernel).__name__ == "InterpretedFunction"


@pytest.fixture(autouse=True, scope="module")
def _interpret_env():
    """TRITON_INTERPRET=1 while this module's tests run (triton imports some parts lazily)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield

ATOL = {torch.float32: 1e-4, torch.float16: 2e-3}


def _case(seed: int, s: int, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype,
          lens: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = [1] + [int(x) for x in torch.randint(2, 6 * bs + 3, (s - 1,), generator=g)]
    max_blocks = max(-(-n // bs) for n in lens) + 1  # one spare column: 0-padded tail
    nb = s * max_blocks + 3
    k_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    # Physical blocks: a random permutation, so each row of the table is scattered.
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(s, max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // bs)
        tables[i, :used] = perm[i * max_blocks: i * max_blocks + used].int()
    q = torch.randn(s, hq, d, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.full((s,), -1, dtype=torch.long),
                             query_start_loc=tuple(range(s + 1)), seq_lens=tuple(lens),
                             block_tables=tables, block_size=bs)
    return q, k_cache, v_cache, meta


def _kernel(q, k_cache, v_cache, meta, scale, window=None):
    sl = torch.tensor(meta.seq_lens, dtype=torch.int32)
    return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, sl, scale, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bs", [4, 8])
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
def test_decode_kernel_matches_ref(hq, hkv, d, bs, dtype):
    seed = hq * 1000 + hkv * 100 + d * 10 + bs + (dtype == torch.float16)
    s = 1 + seed % 5
    q, k_cache, v_cache, meta = _case(seed, s, hq, hkv, d, bs, dtype)
    scale = d ** -0.5
    out = _kernel(q, k_cache, v_cache, meta, scale)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype and out.shape == ref.shape
    assert ref.abs().max() > 0.1  # the comparison is not vacuous
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("window", [1, 5, 16, 1000])
def test_decode_kernel_sliding_window(window, dtype):
    # Lengths below, at and past the window; BLOCK_N=16 tiles start before the window's edge.
    q, k_cache, v_cache, meta = _case(7, 5, 8, 2, 32, 4, dtype, lens=[1, 5, 17, 30, 41])
    out = _kernel(q, k_cache, v_cache, meta, 0.2, window)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.2, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    if window < 30:  # the window changes the answer, so it is really applied
        full = paged_attention_ref(q, k_cache, v_cache, meta, 0.2)
        assert (full.float() - ref.float()).abs().max() > 1e-2


def test_dispatch_uses_kernel_for_pure_decode(monkeypatch):
    # paged_attention imports the kernel module lazily; whatever imported it before (in compiled
    # mode, on a machine with no GPU driver) must not decide how it runs here.
    monkeypatch.delitem(sys.modules, "epserve.kernels.paged_attention_triton", raising=False)
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


def test_dispatch_keeps_ref_for_prefill(monkeypatch):
    q, k_cache, v_cache, meta = _case(12, 2, 4, 2, 16, 4, torch.float32, lens=[5, 9])
    q = torch.randn(5, 4, 16)
    meta = AttentionMetadata(slot_mapping=torch.full((5,), -1, dtype=torch.long),
                             query_start_loc=(0, 2, 5), seq_lens=meta.seq_lens,
                             block_tables=meta.block_tables, block_size=4)
    import epserve.kernels.paged_attention_triton as pat

    def no_kernel(*args, **kwargs):
        raise AssertionError("the decode kernel ran on a prefill batch")

    monkeypatch.setattr(pat, "paged_decode_attention", no_kernel)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.25))


def test_wrapper_rejects_bad_inputs():
    q, k_cache, v_cache, meta = _case(13, 2, 4, 2, 16, 4, torch.float32, lens=[3, 6])
    sl = torch.tensor(meta.seq_lens, dtype=torch.int32)
    bt = meta.block_tables
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(torch.randn(2, 3, 16), k_cache, v_cache, bt, sl, 1.0)
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention(q.half(), k_cache, v_cache, bt, sl, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        kt = k_cache.transpose(0, 1).contiguous().transpose(0, 1)
        paged_decode_attention(q, kt, v_cache, bt, sl, 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, k_cache, v_cache, bt.long(), sl, 1.0)
    with pytest.raises(ValueError, match="seq_lens_t"):
        paged_decode_attention(q, k_cache, v_cache, bt, sl[:1], 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(torch.randn(2, 4, 8), k_cache, v_cache, bt, sl, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(q, k_cache, v_cache, bt, sl, 1.0, sliding_window=0)


def test_head_dim_not_power_of_two():
    q, k_cache, v_cache, meta = _case(14, 3, 4, 2, 24, 4, torch.float32, lens=[1, 6, 11])
    out = _kernel(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.2),
                               atol=1e-4, rtol=0)
