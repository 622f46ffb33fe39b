"""The Triton paged prefill attention kernel (interpreter on CPU) equals ``paged_attention_ref``,
and ``paged_attention`` picks it for every batch that is not pure decode (the rest of the
attention op's tests are in test_attention.py).

Mixed batches (full prefills, chunks starting mid-sequence, decode rows, empty sequences,
padded rows) over random caches and scattered block tables; fp32 to 1e-4 and fp16 to 2e-3.
"""

from __future__ import annotations

import pytest
from kernel_interp import HAS_TRITON, interpreted_modules, use_interpreted
from paged_case import paged_kv

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402

from epserve.kernels import attention  # noqa: E402
from epserve.kernels.attention import AttentionMetadata, paged_attention, paged_attention_ref  # noqa: E402

# The prefill kernel, and the decode kernel that pure decode batches dispatch to, interpreted.
_NAMES = ("paged_prefill", "paged_attention")
_MODS = interpreted_modules(*_NAMES)
ppt, pdt = _MODS
assert ppt.INTERPRETED and pdt.INTERPRETED
CPU = torch.device("cpu")
ATOL = {torch.float32: 1e-4, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _interpret_env(monkeypatch):
    """TRITON_INTERPRET=1 and this module's interpreted kernels for paged_attention's imports
    (another test module may have imported a compiled copy of the decode kernel)."""
    use_interpreted(monkeypatch, _NAMES, _MODS)


def _case(seed, lens, ns, hq, hkv, d, bs, dtype, pad=0):
    """Sequence s has KV length lens[s] and its last ns[s] positions as rows; pad extra rows."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = paged_kv(g, lens, hkv, d, bs, dtype)
    qsl = [0]
    for n in ns:
        qsl.append(qsl[-1] + n)
    t = qsl[-1] + pad
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.full((t,), -1, dtype=torch.long),
                             query_start_loc=tuple(qsl), seq_lens=tuple(lens),
                             block_tables=tables, block_size=bs)
    return q, k_cache, v_cache, meta


def _kernel(q, k_cache, v_cache, meta, scale, window=None, block_m=32, **kw):
    tok = ppt.tokens_per_tile(q.shape[1], k_cache.shape[2], block_m)
    tiles = ppt.build_tile_map(meta.query_start_loc, meta.seq_lens, tok, CPU)
    return ppt.paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, tiles, scale,
                                       window, **kw)


# Decode rows first (as batch.py builds them), then a full prefill longer than a tile, a chunk
# starting mid-block, a short chunk, a sequence with no rows this step, one more decode row.
LENS = [7, 19, 45, 53, 12, 30, 9]
NS = [1, 1, 45, 21, 3, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bs", [16, 8])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2)], ids=["g1", "g2", "g4"])
def test_prefill_kernel_matches_ref(hq, hkv, bs, dtype):
    seed = hq * 100 + hkv * 10 + bs + (dtype == torch.float16)
    q, k_cache, v_cache, meta = _case(seed, LENS, NS, hq, hkv, 32, bs, dtype, pad=3)
    out = _kernel(q, k_cache, v_cache, meta, 32 ** -0.5)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 32 ** -0.5)
    assert out.dtype == dtype and out.shape == ref.shape
    assert ref.abs().max() > 0.1  # the comparison is not vacuous
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))  # padded rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("window", [1, 5, 16, 1000])
def test_prefill_kernel_sliding_window(window, dtype):
    # Windows inside one KV tile, across tiles, and wider than every sequence.
    q, k_cache, v_cache, meta = _case(7, [40, 50, 6, 23], [40, 17, 1, 5], 8, 2, 32, 8, dtype)
    out = _kernel(q, k_cache, v_cache, meta, 0.2, window)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.2, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[dtype], rtol=0)
    if window < 40:  # the window changes the answer, so it is really applied
        full = paged_attention_ref(q, k_cache, v_cache, meta, 0.2)
        assert (full.float() - ref.float()).abs().max() > 1e-2


@pytest.mark.parametrize("block_m,block_n,window", [(16, 32, None), (64, 16, 9), (16, 16, 3)])
def test_prefill_kernel_tile_shapes(block_m, block_n, window):
    # Other folded tile heights (2 and 8 tokens of a group of 8) and KV tile widths.
    q, k_cache, v_cache, meta = _case(3, [33, 20, 5], [33, 9, 1], 8, 1, 16, 8, torch.float32,
                                      pad=1)
    out = _kernel(q, k_cache, v_cache, meta, 0.3, window, block_m=block_m, block_n=block_n)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.3, window)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_head_dim_not_power_of_two_and_rows_before_first_sequence():
    q, k_cache, v_cache, meta = _case(14, [6, 11], [6, 4], 6, 2, 24, 4, torch.float32)
    # Rows [0, 2) belong to no sequence: the batch starts at query_start_loc[0] = 2.
    q = torch.cat([torch.randn(2, 6, 24), q])
    meta = AttentionMetadata(torch.full((q.shape[0],), -1), (2, 8, 12), meta.seq_lens,
                             meta.block_tables, 4)
    out = _kernel(q, k_cache, v_cache, meta, 0.2)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))


def test_tile_map_layout():
    tm = ppt.build_tile_map((0, 1, 21, 21, 24), (5, 20, 9, 30), 8, CPU)
    assert (tm.tok, tm.row_lo, tm.row_hi) == (8, 0, 24)
    rows = [tuple(r) for r in tm.tiles.tolist()]
    # (first row, rows, first position, sequence), the most KV positions walked first.
    assert rows == [(21, 3, 27, 3), (17, 4, 16, 1), (9, 8, 8, 1), (1, 8, 0, 1), (0, 1, 4, 0)]
    empty = ppt.build_tile_map((0, 0), (4,), 8, CPU)
    assert empty.tiles.shape == (0, 4)
    with pytest.raises(ValueError, match="power of two"):
        ppt.build_tile_map((0, 1), (1,), 6, CPU)


def test_no_rows_at_all_gives_zeros():
    q, k_cache, v_cache, meta = _case(5, [4, 9], [0, 0], 4, 2, 16, 4, torch.float32, pad=2)
    out = _kernel(q, k_cache, v_cache, meta, 0.5)
    assert torch.equal(out, torch.zeros_like(out))


def test_dispatch_uses_kernel_for_mixed_batch(monkeypatch):
    q, k_cache, v_cache, meta = _case(11, LENS, NS, 8, 2, 16, 8, torch.float32, pad=2)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.25, 7)
    builds = []
    real_build = ppt.build_tile_map

    def counting_build(*args, **kwargs):
        builds.append(1)
        return real_build(*args, **kwargs)

    def no_ref(*args, **kwargs):
        raise AssertionError("paged_attention fell back to the reference on a mixed batch")

    monkeypatch.setattr(ppt, "build_tile_map", counting_build)
    monkeypatch.setattr(attention, "paged_attention_ref", no_ref)
    for _ in range(2):  # two layers of one step: one tile map
        out = paged_attention(q, k_cache, v_cache, meta, 0.25, 7)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert len(builds) == 1


def test_dispatch_keeps_decode_kernel_for_pure_decode(monkeypatch):
    q, k_cache, v_cache, meta = _case(12, [5, 9, 17], [1, 1, 1], 4, 2, 16, 4, torch.float32)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the prefill kernel ran on a pure decode batch")

    monkeypatch.setattr(ppt, "paged_prefill_attention", no_kernel)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(out, paged_attention_ref(q, k_cache, v_cache, meta, 0.25),
                               atol=1e-4, rtol=0)


def test_dispatch_keeps_ref_off_cuda_and_for_other_layouts(monkeypatch):
    q, k_cache, v_cache, meta = _case(13, [6, 9], [6, 2], 4, 2, 16, 4, torch.float32)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the prefill kernel ran")

    monkeypatch.setattr(ppt, "paged_prefill_attention", no_kernel)
    long_tables = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                                    meta.block_tables.long(), meta.block_size)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, long_tables, 0.25), ref)
    torch.testing.assert_close(paged_attention(q, k_cache.double(), v_cache, meta, 0.25), ref)
    monkeypatch.delenv("TRITON_INTERPRET")
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 0.25), ref)


def test_dispatch_sends_out_of_contract_to_ref():
    q, k_cache, v_cache, meta = _case(15, [6, 9], [6, 2], 4, 2, 16, 4, torch.float32)
    too_many = AttentionMetadata(torch.full((9,), -1), (0, 7, 9), meta.seq_lens,
                                 meta.block_tables, 4)  # 7 new rows, seq_len 6
    with pytest.raises(ValueError, match="new rows"):
        paged_attention(torch.randn(9, 4, 16), k_cache, v_cache, too_many, 0.25)


def test_wrapper_rejects_bad_inputs():
    q, k_cache, v_cache, meta = _case(16, [6, 9], [6, 2], 4, 2, 16, 4, torch.float32)
    bt = meta.block_tables
    tm = ppt.build_tile_map(meta.query_start_loc, meta.seq_lens, 16, CPU)
    run = ppt.paged_prefill_attention
    with pytest.raises(ValueError, match="multiple"):
        run(torch.randn(8, 3, 16), k_cache, v_cache, bt, tm, 1.0)
    with pytest.raises(ValueError, match="dtypes"):
        run(q.half(), k_cache, v_cache, bt, tm, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        kt = k_cache.transpose(0, 1).contiguous().transpose(0, 1)
        run(q, kt, v_cache, bt, tm, 1.0)
    with pytest.raises(ValueError, match="int32"):
        run(q, k_cache, v_cache, bt.long(), tm, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        run(torch.randn(8, 4, 8), k_cache, v_cache, bt, tm, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        run(q, k_cache, v_cache, bt, tm, 1.0, sliding_window=0)
    with pytest.raises(ValueError, match="not inside"):
        run(q[:5], k_cache, v_cache, bt, tm, 1.0)
    with pytest.raises(ValueError, match="tok"):
        run(q, k_cache, v_cache, bt, ppt.build_tile_map((0, 6, 8), (6, 9), 4, CPU), 1.0)
    with pytest.raises(ValueError, match="block_n"):
        run(q, k_cache, v_cache, bt, tm, 1.0, block_n=8)
    with pytest.raises(ValueError, match="tile_map"):
        run(q, k_cache, v_cache, bt, ppt.TileMap(tm.tiles.long(), 16, 0, 8), 1.0)
