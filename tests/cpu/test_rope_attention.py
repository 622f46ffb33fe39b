"""The attention core of a layer (``rope_and_attend``): decode attention with its q/k norm +
rope + KV-write prologue in one launch (Triton interpreter on CPU) against its definition, the
two launches it replaces.

Exact where the work is the same code: q and k (normed and rotated in place) and both caches
bit for bit against ``qk_norm_rope_triton`` with the KV write; the attention output to float
rounding against ``paged_decode_attention`` on those (fp32 1e-5, fp16 2e-3: the fused launch
fuses no multiply-adds), and against the torch references (``apply_qk_norm_rope_ref``,
``write_kv_ref``, ``paged_attention_ref``). Cases: with and without q/k norm, GQA groups 1, 2
and 4, a padding row (slot -1, one position), a sliding window, bad arguments.
"""

from __future__ import annotations

import pytest
from kernel_interp import HAS_TRITON, interpreted_modules, use_interpreted

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402

from epserve.kernels.attention import AttentionMetadata, paged_attention_ref  # noqa: E402
from epserve.kernels.kv_write import write_kv_ref  # noqa: E402
from epserve.kernels.rope import apply_qk_norm_rope_ref, build_rope_cache  # noqa: E402

_NAMES = ("rope_decode", "paged_attention", "rope")
_MODS = interpreted_modules(*_NAMES)
rd, pa, rt = _MODS
assert rd.INTERPRETED and pa.INTERPRETED and rt.INTERPRETED
assert rd.paged_decode_kernel is pa.paged_decode_kernel  # the fused launch runs these copies
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    use_interpreted(monkeypatch, _NAMES, _MODS)


def _case(lens, hq, hkv, d, dtype, seed, bs=4, pad_row=None):
    """A decode step over sequences of ``lens`` tokens (the newest is this step's): q, k, v
    views of one projection, random caches holding the earlier tokens, block tables, slots."""
    g = torch.Generator().manual_seed(seed)
    s = len(lens)
    width = max(-(-n // bs) for n in lens)
    nb = s * width + 2
    perm = torch.randperm(nb, generator=g)
    tables = perm[:s * width].view(s, width).to(torch.int32)
    cos, sin = build_rope_cache(d, 128, 10000.0)
    qkv = torch.randn(s, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, :hq * d].view(s, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(s, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(s, hkv, d)
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs
                          for i, n in enumerate(lens)])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if pad_row is not None:  # a CUDA-graph padding row: no KV write, one position read
        slots[pad_row] = -1
        seq_lens[pad_row] = 1
        positions[pad_row] = 0
    qw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    return dict(q=q, k=k, v=v, positions=positions, cos=cos, sin=sin, qw=qw, kw=kw, kc=kc, vc=vc,
                slots=slots, tables=tables, seq_lens=seq_lens)


def _fused(c, scale, window=None):
    return rd.rope_paged_decode_triton(c["q"], c["k"], c["v"], c["positions"], c["cos"],
                                       c["sin"], c["qw"], c["kw"], 1e-6, c["kc"], c["vc"],
                                       c["slots"], c["tables"], c["seq_lens"], scale, window)


def _two_launches(c, scale, window=None):
    rt.qk_norm_rope_triton(c["q"], c["k"], c["positions"], c["cos"], c["sin"], c["qw"], c["kw"],
                           1e-6, v=c["v"], k_cache=c["kc"], v_cache=c["vc"],
                           slot_mapping=c["slots"])
    return pa.paged_decode_attention(c["q"], c["kc"], c["vc"], c["tables"], c["seq_lens"], scale,
                                     window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_qk_norm"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
def test_matches_the_two_launches(dtype, norm, heads):
    hq, hkv = heads
    # three copies of the same inputs (same seed): fused, two launches, references
    c, base, ref = (_case([1, 6, 13, 9], hq, hkv, 16, dtype, seed=hq * 7 + hkv, pad_row=3)
                    for _ in range(3))
    if not norm:
        for case in (c, base, ref):
            case["qw"] = case["kw"] = None
    scale = 16 ** -0.5
    got = _fused(c, scale)
    want = _two_launches(base, scale)
    for key in ("q", "k", "kc", "vc"):
        assert torch.equal(c[key], base[key]), key
    torch.testing.assert_close(got, want, **TOL[dtype])
    # and the torch references, from the same inputs
    rq, rk = apply_qk_norm_rope_ref(ref["q"], ref["k"], ref["positions"], ref["cos"], ref["sin"],
                                    ref["qw"], ref["kw"], 1e-6)
    write_kv_ref(rk, ref["v"], ref["kc"], ref["vc"], ref["slots"])
    meta = AttentionMetadata(slot_mapping=ref["slots"], query_start_loc=tuple(range(5)),
                             seq_lens=tuple(int(x) for x in ref["seq_lens"]),
                             block_tables=ref["tables"], block_size=4)
    want_ref = paged_attention_ref(rq, ref["kc"], ref["vc"], meta, scale)
    torch.testing.assert_close(got, want_ref, **TOL[dtype])


def test_sliding_window():
    c, base = (_case([11, 3], 4, 2, 16, torch.float32, seed=5) for _ in range(2))
    torch.testing.assert_close(_fused(c, 0.25, window=4), _two_launches(base, 0.25, window=4),
                               **TOL[torch.float32])


def test_bad_arguments_are_refused():
    c = _case([3, 5], 4, 2, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="one row per sequence"):
        rd.rope_paged_decode_triton(c["q"], c["k"], c["v"], c["positions"], c["cos"], c["sin"],
                                    c["qw"], c["kw"], 1e-6, c["kc"], c["vc"], c["slots"],
                                    c["tables"], c["seq_lens"].long(), 0.25)
    with pytest.raises(ValueError, match="sliding_window"):
        _fused(c, 0.25, window=0)
    with pytest.raises(ValueError, match="must share T"):
        rd.rope_paged_decode_triton(c["q"], c["k"][:1], c["v"], c["positions"], c["cos"],
                                    c["sin"], c["qw"], c["kw"], 1e-6, c["kc"], c["vc"],
                                    c["slots"], c["tables"], c["seq_lens"], 0.25)


def test_attention_layer_entry_takes_one_launch_for_a_pure_decode_step(monkeypatch):
    """``rope_and_attend`` (what Attention.forward calls) runs the fused launch for a pure
    decode step with device lengths, the two launches otherwise; same results either way."""
    from epserve.kernels.rope_attention import rope_and_attend

    calls = []
    fused = rd.rope_paged_decode_triton
    monkeypatch.setattr(rd, "rope_paged_decode_triton",
                        lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    c, other = (_case([4, 9, 2], 8, 2, 16, torch.float32, seed=9) for _ in range(2))
    outs = []
    for case, lens_t in ((c, c["seq_lens"]), (other, None)):
        meta = AttentionMetadata(slot_mapping=case["slots"], query_start_loc=(0, 1, 2, 3),
                                 seq_lens=tuple(int(x) for x in case["seq_lens"]),
                                 block_tables=case["tables"], block_size=4, seq_lens_t=lens_t)
        outs.append(rope_and_attend(case["q"], case["k"], case["v"], case["positions"],
                                    case["cos"], case["sin"], case["qw"], case["kw"], 1e-6,
                                    case["kc"], case["vc"], meta, 0.25))
        assert len(calls) == 1  # the first (device lengths) fused; the second did not
    torch.testing.assert_close(outs[0], outs[1], **TOL[torch.float32])
    for key in ("q", "k", "kc", "vc"):
        assert torch.equal(c[key], other[key]), key
