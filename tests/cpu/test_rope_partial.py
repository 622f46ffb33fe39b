"""The hybrids' gated attention core (Qwen3-Next, Qwen3.5) on the Triton path (interpreter on
CPU): zero-centred q/k norms, partial rotary (only the first R of D dims rotate, the rest pass
through normalised) and this step's KV write in one launch (``qk_norm_rope_triton``), and the
fused decode launch with the output gate (``rope_paged_decode_triton``), against the
definitions: ``apply_qk_norm_rope_ref(..., zero_centred=True)``, ``write_kv_ref``,
``paged_attention_ref`` and ``attention_gate_ref``; and ``rope_and_attend``, the layer's one
call, on the reference path and the interpreted one.

Tolerances as test_rope.py (fp32 1e-5, fp16 2e-3). The fused decode launch equals the two
launches bit for bit in q, k and the caches (the same code), the gated output to float rounding.
Shapes: R / D of 4 / 16 (Qwen's 0.25), 8 / 12, and 6 / 20 (neither half a power of two), GQA
groups 1, 2 and 4, padding rows (slot -1).
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
from epserve.kernels.rope_attention import attention_gate_ref, rope_and_attend  # noqa: E402

_NAMES = ("rope_decode", "paged_attention", "rope", "kv_write", "paged_prefill")
_MODS = interpreted_modules(*_NAMES)
rd, pa, rt, _, _ = _MODS
assert rd.INTERPRETED and rt.INTERPRETED
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
ROT = pytest.mark.parametrize("d,r", [(16, 4), (12, 8), (20, 6)], ids=["D16R4", "D12R8", "D20R6"])


@pytest.fixture
def interpret(monkeypatch):
    use_interpreted(monkeypatch, _NAMES, _MODS)


def _case(lens, hq, hkv, d, r, dtype, seed, bs=4, pad_row=None):
    """A decode step over sequences of ``lens`` tokens (the newest is this step's), as the gated
    attention makes it: q, gate, k, v views of one projection [S, 2 Hq D + 2 Hkv D]; zero-centred
    weights (around 0); random caches; block tables; slots (``pad_row``: a padding row)."""
    g = torch.Generator().manual_seed(seed)
    s = len(lens)
    width = max(-(-n // bs) for n in lens)
    nb = s * width + 2
    tables = torch.randperm(nb, generator=g)[:s * width].view(s, width).to(torch.int32)
    cos, sin = build_rope_cache(r, 128, 10000.0)
    qs, ks = hq * d, hkv * d
    proj = torch.randn(s, 2 * qs + 2 * ks, generator=g).to(dtype)
    c = dict(proj=proj, q=proj[:, :qs].view(s, hq, d), gate=proj[:, qs:2 * qs].view(s, hq, d),
             k=proj[:, 2 * qs:2 * qs + ks].view(s, hkv, d), v=proj[:, 2 * qs + ks:].view(s, hkv, d))
    c["qw"] = (0.05 * torch.randn(d, generator=g)).to(dtype)
    c["kw"] = (0.05 * torch.randn(d, generator=g)).to(dtype)
    c["kc"] = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    c["vc"] = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs
                          for i, n in enumerate(lens)])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if pad_row is not None:
        slots[pad_row], seq_lens[pad_row], positions[pad_row] = -1, 1, 0
    c.update(cos=cos, sin=sin, positions=positions, slots=slots, tables=tables, seq_lens=seq_lens)
    return c


def _copies(n, *args, **kw):
    return [_case(*args, **kw) for _ in range(n)]


def _meta(c, lens_t=True):
    s = c["q"].shape[0]
    return AttentionMetadata(slot_mapping=c["slots"], query_start_loc=tuple(range(s + 1)),
                             seq_lens=tuple(int(x) for x in c["seq_lens"]),
                             block_tables=c["tables"], block_size=c["kc"].shape[1],
                             seq_lens_t=c["seq_lens"] if lens_t else None)


def _reference(c, scale):
    """The definition on a fresh copy: normed + rotated q, k; caches written; gated output."""
    rq, rk = apply_qk_norm_rope_ref(c["q"], c["k"], c["positions"], c["cos"], c["sin"], c["qw"],
                                    c["kw"], 1e-6, zero_centred=True)
    write_kv_ref(rk, c["v"], c["kc"], c["vc"], c["slots"])
    out = paged_attention_ref(rq, c["kc"], c["vc"], _meta(c, lens_t=False), scale)
    return rq, rk, attention_gate_ref(out, c["gate"])


# --------------------------------------------------------------------------- norm + rope + KV


@DTYPES
@ROT
@pytest.mark.parametrize("zc", [True, False], ids=["zero_centred", "plain"])
@pytest.mark.parametrize("weights", [True, False], ids=["qk_norm", "no_qk_norm"])
def test_partial_rotary_with_kv_write_matches_ref(d, r, zc, weights, dtype, interpret):
    c, ref = _copies(2, [3, 7, 2, 5], 4, 2, d, r, dtype, seed=d + r, pad_row=2)
    if not weights:
        for x in (c, ref):
            x["qw"] = x["kw"] = None
    kc0, vc0 = c["kc"].clone(), c["vc"].clone()
    rq, rk = apply_qk_norm_rope_ref(ref["q"], ref["k"], ref["positions"], ref["cos"], ref["sin"],
                                    ref["qw"], ref["kw"], 1e-6, zero_centred=zc)
    write_kv_ref(rk, ref["v"], ref["kc"], ref["vc"], ref["slots"])
    rt.qk_norm_rope_triton(c["q"], c["k"], c["positions"], c["cos"], c["sin"], c["qw"], c["kw"],
                           1e-6, v=c["v"], k_cache=c["kc"], v_cache=c["vc"],
                           slot_mapping=c["slots"], zero_centred=zc)
    for key, want in (("q", rq), ("k", rk), ("kc", ref["kc"]), ("vc", ref["vc"])):
        torch.testing.assert_close(c[key], want, **TOL[dtype], msg=key)
    assert torch.equal(c["gate"], ref["gate"])  # the gate's part of the projection is not touched
    own_kc, own_vc = kc0, vc0  # the cache holds the kernel's own k and v exactly
    write_kv_ref(c["k"], c["v"], own_kc, own_vc, c["slots"])
    assert torch.equal(c["kc"], own_kc) and torch.equal(c["vc"], own_vc)
    if not weights:  # nothing normalises the tail: it passes through bit for bit
        assert torch.equal(c["q"][..., r:], ref["q"][..., r:])


def test_partial_rotary_prefill_tile(interpret):
    """A prefill-sized step (several (token, head) rows per program, rows past the end)."""
    c = _case([40], 6, 2, 20, 6, torch.float32, seed=3)  # its weights and caches
    t = 40
    pos = torch.arange(t) * 3 % 128
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(t, 6, 20, generator=g), torch.randn(t, 2, 20, generator=g)
    rq, rk = apply_qk_norm_rope_ref(q, k, pos, c["cos"], c["sin"], c["qw"], c["kw"], 1e-6, True)
    rt.qk_norm_rope_triton(q, k, pos, c["cos"], c["sin"], c["qw"], c["kw"], 1e-6,
                           zero_centred=True)
    torch.testing.assert_close(q, rq, **TOL[torch.float32])
    torch.testing.assert_close(k, rk, **TOL[torch.float32])


def test_zero_centred_weight_is_added_in_float32(interpret):
    """bf16 weights of 0.003: ``1 + w`` in bf16 is 1, so a folded weight would drop them; the
    kernel's fp32 result carries them as the reference does."""
    c = _case([2, 3], 4, 2, 16, 4, torch.float32, seed=8)
    w = torch.full((16,), 0.003, dtype=torch.bfloat16)
    assert torch.equal(1 + w, torch.ones_like(w))
    q, k = c["q"].clone(), c["k"].clone()
    rq, rk = apply_qk_norm_rope_ref(q, k, c["positions"], c["cos"], c["sin"], w, w, 1e-6, True)
    pq, _ = apply_qk_norm_rope_ref(q, k, c["positions"], c["cos"], c["sin"], torch.ones(16),
                                   torch.ones(16), 1e-6)
    rt.qk_norm_rope_triton(q, k, c["positions"], c["cos"], c["sin"], w, w, 1e-6,
                           zero_centred=True)
    torch.testing.assert_close(q, rq, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, rk, atol=1e-6, rtol=1e-6)
    assert ((q - pq).abs() > 1e-4).any()  # the 0.3% is there


# --------------------------------------------------------------------------- the fused decode


@DTYPES
@ROT
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
def test_fused_decode_with_gate_matches_the_two_launches(d, r, heads, dtype, interpret):
    hq, hkv = heads
    c, base, ref = _copies(3, [1, 6, 13, 9], hq, hkv, d, r, dtype, seed=hq * 7 + d, pad_row=3)
    scale = d ** -0.5
    got = rd.rope_paged_decode_triton(c["q"], c["k"], c["v"], c["positions"], c["cos"], c["sin"],
                                      c["qw"], c["kw"], 1e-6, c["kc"], c["vc"], c["slots"],
                                      c["tables"], c["seq_lens"], scale, zero_centred=True,
                                      gate=c["gate"])
    rt.qk_norm_rope_triton(base["q"], base["k"], base["positions"], base["cos"], base["sin"],
                           base["qw"], base["kw"], 1e-6, v=base["v"], k_cache=base["kc"],
                           v_cache=base["vc"], slot_mapping=base["slots"], zero_centred=True)
    two = pa.paged_decode_attention(base["q"], base["kc"], base["vc"], base["tables"],
                                    base["seq_lens"], scale)
    for key in ("q", "k", "kc", "vc", "gate"):
        assert torch.equal(c[key], base[key]), key
    torch.testing.assert_close(got, attention_gate_ref(two, base["gate"]), **TOL[dtype])
    rq, rk, want = _reference(ref, scale)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(c["q"], rq, **TOL[dtype])


def test_fused_decode_refuses_a_bad_gate(interpret):
    c = _case([3, 5], 4, 2, 16, 4, torch.float32, seed=1)
    with pytest.raises(ValueError, match="gate"):
        rd.rope_paged_decode_triton(c["q"], c["k"], c["v"], c["positions"], c["cos"], c["sin"],
                                    c["qw"], c["kw"], 1e-6, c["kc"], c["vc"], c["slots"],
                                    c["tables"], c["seq_lens"], 0.25, gate=c["gate"][:, :2])


# --------------------------------------------------------------------------- the layer's call


@pytest.mark.parametrize("lens_t", [True, False], ids=["fused", "two_launches"])
def test_rope_and_attend_gated_on_both_paths(lens_t, monkeypatch):
    """``rope_and_attend`` as GatedAttention calls it, on the reference path (no interpreter:
    what the CPU runs) and on the interpreted kernels (one fused launch for a decode step with
    device lengths; else the two launches and the gate in torch): the same results."""
    cases = _copies(2, [4, 9, 2], 8, 2, 16, 4, torch.float32, seed=9, pad_row=1)
    outs = []
    for i, c in enumerate(cases):
        if i:
            use_interpreted(monkeypatch, _NAMES, _MODS)
            calls, fused = [], rd.rope_paged_decode_triton
            monkeypatch.setattr(rd, "rope_paged_decode_triton",
                                lambda *a, **kw: calls.append(1) or fused(*a, **kw))
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        outs.append(rope_and_attend(c["q"], c["k"], c["v"], c["positions"], c["cos"], c["sin"],
                                    c["qw"], c["kw"], 1e-6, c["kc"], c["vc"],
                                    _meta(c, lens_t), 0.25, zero_centred=True, gate=c["gate"]))
    assert calls == ([1] if lens_t else [])
    torch.testing.assert_close(outs[1], outs[0], **TOL[torch.float32])
    for key in ("q", "k", "kc", "vc"):
        torch.testing.assert_close(cases[1][key], cases[0][key], **TOL[torch.float32], msg=key)
