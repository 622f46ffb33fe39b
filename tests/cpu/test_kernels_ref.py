"""The kernel references against straightforward dense computations on random inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from epserve.kernels.attention import AttentionMetadata, paged_attention
from epserve.kernels.kv_write import write_kv
from epserve.kernels.moe import fused_moe, fused_moe_ref
from epserve.kernels.norm import fused_add_rms_norm, rms_norm
from epserve.kernels.rope import apply_rope, build_rope_cache

# --------------------------------------------------------------------------- attention


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
def test_paged_attention_matches_dense_causal(window, hkv):
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


def test_write_kv_writes_slots_and_skips_padding():
    k_cache, v_cache = torch.zeros(6, 4, 2, 3), torch.zeros(6, 4, 2, 3)
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    write_kv(k, v, k_cache, v_cache, torch.tensor([13, -1, 2]))
    torch.testing.assert_close(k_cache[3, 1], k[0])
    torch.testing.assert_close(v_cache[0, 2], v[2])
    assert int((k_cache.abs().sum(-1).sum(-1) > 0).sum()) == 2  # the -1 row wrote nothing


def test_paged_attention_half_precision_returns_query_dtype():
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


# --------------------------------------------------------------------------- moe


def _moe_case(t=13, h=16, inter=8, e=8, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * 0.3
    w2 = torch.randn(e, h, inter, generator=g) * 0.3
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    return x, w13, w2, ids, weights


def test_fused_moe_matches_per_token_loop():
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
def test_fused_moe_expert_shards_sum_to_full(shards):
    x, w13, w2, ids, weights = _moe_case(seed=1)
    full = fused_moe_ref(x, w13, w2, ids, weights)
    per = w13.shape[0] // shards
    parts = [fused_moe(x, w13[r * per:(r + 1) * per], w2[r * per:(r + 1) * per], ids, weights,
                       expert_offset=r * per) for r in range(shards)]
    assert all(p.abs().sum() > 0 for p in parts)
    torch.testing.assert_close(sum(parts), full, atol=1e-5, rtol=1e-5)


def test_fused_moe_ids_outside_the_shard_contribute_nothing():
    x, w13, w2, _, weights = _moe_case()
    ids = torch.full((x.shape[0], 2), 100)
    assert torch.equal(fused_moe(x, w13, w2, ids, weights), torch.zeros_like(x))


def test_fused_moe_rejects_bad_shapes():
    x, w13, w2, ids, weights = _moe_case()
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :-1], ids, weights)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, ids[:-1], weights)


# --------------------------------------------------------------------------- rope and norm


def test_rope_matches_complex_rotation():
    d, theta = 16, 10000.0
    cos, sin = build_rope_cache(d, 64, theta)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 4, d, generator=g), torch.randn(5, 2, d, generator=g)
    pos = torch.tensor([0, 3, 17, 63, 1])
    q_rot, k_rot = apply_rope(q, k, pos, cos, sin)

    def direct(x):
        half = d // 2
        freqs = torch.tensor([theta ** (-2 * i / d) for i in range(half)], dtype=torch.float64)
        angle = pos.double()[:, None, None] * freqs  # [T, 1, D/2]
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.exp(1j * angle)
        return torch.cat([z.real, z.imag], dim=-1).float()

    torch.testing.assert_close(q_rot, direct(q), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_rot, direct(k), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(q_rot[0], q[0])  # position 0 is the identity


def test_rms_norm_and_fused_add():
    g = torch.Generator().manual_seed(3)
    x, res, w = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g), torch.randn(32, generator=g)
    ref = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), ref, atol=1e-5, rtol=1e-5)
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, rms_norm(x + res, w, 1e-6))
    assert rms_norm(x.bfloat16(), w.bfloat16(), 1e-6).dtype == torch.bfloat16
    assert math.isfinite(float(rms_norm(torch.zeros(1, 32), w, 1e-6).sum()))
