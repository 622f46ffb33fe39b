"""The fused q/k norm + rope + KV write + decode attention launch on CUDA at the Qwen3-30B-A3B
attention shape (32 q heads, 4 kv heads, D 128, bf16) against the two launches it replaces:
q, k and both caches bit for bit, the output within bf16 rounding (the fused launch fuses no
multiply-adds); a graph-padding row writes nothing. Prints microseconds per CUDA-graph replay
of each at batch 1."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from decode_case import decode_layout
from gpu_timing import graph_us

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

HQ, HKV, D, BS = 32, 4, 128, 16


def _case(lens, seed):
    from epserve.kernels.rope import build_rope_cache

    g = torch.Generator(device="cuda").manual_seed(seed)
    lay = decode_layout(lens, BS, g)  # the last row is CUDA-graph padding
    s, nb = len(lens), lay.pop("nb")
    cos, sin = build_rope_cache(D, 4096, 1e6)
    qkv = torch.randn(s, (HQ + 2 * HKV) * D, device="cuda", generator=g).bfloat16()
    kc = torch.randn(nb, BS, HKV, D, device="cuda", generator=g).bfloat16()
    vc = torch.randn(nb, BS, HKV, D, device="cuda", generator=g).bfloat16()
    w = [(1 + 0.1 * torch.randn(D, device="cuda", generator=g)).bfloat16() for _ in range(2)]
    return dict(qkv=qkv, kc=kc, vc=vc, **lay, cos=cos.cuda(), sin=sin.cuda(), qw=w[0],
                kw=w[1])


def _views(qkv):
    s = qkv.shape[0]
    return (qkv[:, :HQ * D].view(s, HQ, D), qkv[:, HQ * D:(HQ + HKV) * D].view(s, HKV, D),
            qkv[:, (HQ + HKV) * D:].view(s, HKV, D))


def _fused(c):
    from epserve.kernels.triton.rope_decode import rope_paged_decode_triton

    q, k, v = _views(c["qkv"])
    return rope_paged_decode_triton(q, k, v, c["pos"], c["cos"], c["sin"], c["qw"], c["kw"],
                                    1e-6, c["kc"], c["vc"], c["slots"], c["tables"], c["lens"],
                                    D ** -0.5)


def _two(c):
    from epserve.kernels.triton.paged_attention import paged_decode_attention
    from epserve.kernels.triton.rope import qk_norm_rope_triton

    q, k, v = _views(c["qkv"])
    qk_norm_rope_triton(q, k, c["pos"], c["cos"], c["sin"], c["qw"], c["kw"], 1e-6, v=v,
                        k_cache=c["kc"], v_cache=c["vc"], slot_mapping=c["slots"])
    return paged_decode_attention(q, c["kc"], c["vc"], c["tables"], c["lens"], D ** -0.5)


def _clone(c):
    return {k: v.clone() for k, v in c.items()}


def _reference(c):
    """The torch references of the fused launch: q/k norm + rope, the KV write, attention."""
    from epserve.kernels.attention import AttentionMetadata, paged_attention_ref
    from epserve.kernels.kv_write import write_kv_ref
    from epserve.kernels.rope import apply_qk_norm_rope_ref

    q, k, v = _views(c["qkv"])
    rq, rk = apply_qk_norm_rope_ref(q, k, c["pos"], c["cos"], c["sin"], c["qw"], c["kw"], 1e-6)
    kc, vc = c["kc"].clone(), c["vc"].clone()
    write_kv_ref(rk, v, kc, vc, c["slots"])
    s = q.shape[0]
    meta = AttentionMetadata(slot_mapping=c["slots"], query_start_loc=tuple(range(s + 1)),
                             seq_lens=tuple(c["lens"].tolist()), block_tables=c["tables"],
                             block_size=BS)
    return paged_attention_ref(rq, kc, vc, meta, D ** -0.5)


@pytest.mark.parametrize("lens", [[37], [5, 300, 17, 1], [(7 * i) % 290 + 2 for i in range(64)]],
                         ids=["S1", "S4", "S64"])
def test_matches_the_two_launches(lens):
    c = _case(lens, seed=len(lens))
    base = _clone(c)
    got, want = _fused(c), _two(base)
    for key in ("qkv", "kc", "vc"):
        assert torch.equal(c[key], base[key]), key
    torch.testing.assert_close(got[:len(lens) - (len(lens) > 1)].float(),
                               want[:len(lens) - (len(lens) > 1)].float(), rtol=2e-2, atol=2e-3)


def test_graph_timing_at_batch_1():
    c = _case([200], seed=3)
    got, ref = _fused(_clone(c)), _reference(c)  # what is timed is correct
    assert ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 2e-2
    fused_us = graph_us(lambda: _fused(c))
    two_us = graph_us(lambda: _two(c))
    print(f"\nbatch 1, 200 positions: fused {fused_us:.2f} us per replay, two launches "
          f"{two_us:.2f} us")
    assert fused_us < two_us * 1.1  # never a regression beyond noise
