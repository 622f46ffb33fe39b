"""q/k norm + rope with the paged KV write fused in (Triton interpreter on CPU) vs the refs, and
the rope kernel's tiling; the rest of the rope op's tests are in test_rope.py.

The definition is ``apply_qk_norm_rope_ref`` then ``write_kv_ref`` of the rotated k and v.
Tolerances: q, k and the cache against that definition as test_rope.py (fp32
atol/rtol 1e-5, fp16 2e-3: the rotation may round differently by one ulp); the cache against
``write_kv_ref`` of the kernel's own rotated k must be exact (a copy plus a dtype cast), and
rows whose slot is not written (slot -1 padding, unused slots) must stay bit for bit.
Every test runs the kernel module in the interpreter (kernel_interp.py: imported with
TRITON_INTERPRET=1, put in sys.modules for each test by an autouse fixture).
"""

from __future__ import annotations

import importlib.util

import pytest
from kernel_interp import HAS_TRITON, PKG, interpreted_modules, use_interpreted

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402

from epserve.kernels.kv_write import write_kv_ref  # noqa: E402
from epserve.kernels.rope import (apply_qk_norm_rope, apply_qk_norm_rope_ref,  # noqa: E402
                                  build_rope_cache)

_NAMES = ("rope",)
_MODS = interpreted_modules(*_NAMES)
rt, = _MODS
assert rt.INTERPRETED

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
OTHER = {torch.float32: torch.float16, torch.float16: torch.float32}  # a cache in another dtype


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    use_interpreted(monkeypatch, _NAMES, _MODS)  # rt is what apply_qk_norm_rope imports


def _case(t, hq, hkv, d, dtype, cache_dtype, seed, nb=4, bs=4, layout="contiguous"):
    """q, k, v: [T, H, D] views of one fused [T, (Hq + 2 Hkv) * D] projection, as Attention
    makes them; caches [NB, BS, Hkv, D] (random, so unwritten rows are recognisable) in
    ``layout``; slots distinct, a middle and the last row (T > 1) padded with -1."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = build_rope_cache(d, 64, 10000.0)
    positions = torch.randint(0, 64, (t,), generator=g)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    qw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    caches = []
    for _ in range(2):
        if layout == "heads_outer":  # [NB, Hkv, BS, D] storage seen as [NB, BS, Hkv, D]
            c = torch.randn(nb, hkv, bs, d, generator=g).to(cache_dtype).transpose(1, 2)
        elif layout == "padded":  # block, offset and head strides all larger than dense
            c = torch.randn(nb + 1, bs, hkv + 1, d + 8, generator=g).to(cache_dtype)
            c = c[1:, :, 1:, 8:]
        else:
            c = torch.randn(nb, bs, hkv, d, generator=g).to(cache_dtype)
        caches.append(c)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    if t > 1:
        slots[t // 2] = -1
        slots[-1] = -1
    return qkv, q, k, v, positions, cos, sin, qw, kw, caches[0], caches[1], slots


def _check_fused(q, k, v, pos, cos, sin, qw, kw, kc, vc, slots, dtype, call):
    """Run ``call`` (fused, in place) and check it against the definition."""
    v0, kc0, vc0 = v.clone(), kc.clone(), vc.clone()
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, kw, 1e-6)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    write_kv_ref(ref_k, v, ref_kc, ref_vc, slots)  # the definition
    got_q, got_k = call(q, k, pos, cos, sin, qw, kw, 1e-6, v=v, k_cache=kc, v_cache=vc,
                        slot_mapping=slots)
    assert got_q is q and got_k is k  # in place
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    assert torch.equal(v, v0)  # v is only read
    own_kc, own_vc = kc0.clone(), vc0.clone()
    write_kv_ref(k, v, own_kc, own_vc, slots)  # the kernel's own rotated k: exact copy
    assert torch.equal(kc, own_kc) and torch.equal(vc, own_vc)
    torch.testing.assert_close(kc.float(), ref_kc.float(), **TOL[dtype])
    assert torch.equal(vc, ref_vc)
    nb, bs = kc.shape[:2]
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    for c, c0 in ((kc, kc0), (vc, vc0)):
        assert torch.equal(c.reshape(nb * bs, *c.shape[2:])[untouched],
                           c0.reshape(nb * bs, *c.shape[2:])[untouched])


@DTYPES
@pytest.mark.parametrize("cache", ["same", "other"], ids=["cache_same", "cache_other_dtype"])
@pytest.mark.parametrize("weights", [True, False], ids=["qk_norm", "no_qk_norm"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 16), (5, 6, 2, 32), (3, 2, 1, 24)],
                         ids=lambda s: "T{}Hq{}Hkv{}D{}".format(*s))
def test_fused_kv_write_matches_ref(shape, weights, cache, dtype):
    cache_dtype = dtype if cache == "same" else OTHER[dtype]
    _, q, k, v, pos, cos, sin, qw, kw, kc, vc, slots = _case(*shape, dtype, cache_dtype,
                                                             seed=sum(shape))
    if not weights:
        qw = kw = None
    _check_fused(q, k, v, pos, cos, sin, qw, kw, kc, vc, slots, dtype, rt.qk_norm_rope_triton)


@pytest.mark.parametrize("layout", ["heads_outer", "padded"])
def test_fused_kv_write_strided_caches(layout):
    _, q, k, v, pos, cos, sin, qw, kw, kc, vc, slots = _case(6, 4, 2, 16, torch.float32,
                                                             torch.float32, 31, layout=layout)
    assert not kc.is_contiguous() and kc.stride(-1) == 1
    _check_fused(q, k, v, pos, cos, sin, qw, kw, kc, vc, slots, torch.float32,
                 rt.qk_norm_rope_triton)


def test_fused_kv_public_entry_runs_the_kernel(monkeypatch):
    """One call: the public entry hands the KV arguments to the kernel (int32 slots and
    positions too), and does not run write_kv separately."""
    _, q, k, v, pos, cos, sin, qw, kw, kc, vc, slots = _case(4, 4, 2, 16, torch.float16,
                                                             torch.float16, 32)
    calls, kernel = [], rt.qk_norm_rope_triton

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(rt, "qk_norm_rope_triton", spy)
    monkeypatch.setattr("epserve.kernels.rope.write_kv", lambda *a: pytest.fail("write_kv ran"))
    _check_fused(q, k, v, pos.int(), cos, sin, qw, kw, kc, vc, slots.int(), torch.float16,
                 apply_qk_norm_rope)
    assert len(calls) == 1 and calls[0]["k_cache"] is kc and calls[0]["slot_mapping"] is not None


def test_fused_kv_all_padding_writes_nothing():
    _, q, k, v, pos, cos, sin, qw, kw, kc, vc, _ = _case(3, 4, 2, 16, torch.float32,
                                                         torch.float32, 33)
    kc0, vc0 = kc.clone(), vc.clone()
    apply_qk_norm_rope(q, k, pos, cos, sin, qw, kw, v=v, k_cache=kc, v_cache=vc,
                       slot_mapping=torch.full((3,), -1))
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    e = torch.empty(0, 4, 16)  # T = 0: no launch, nothing written
    apply_qk_norm_rope(e, e[:, :2], pos[:0], cos, sin, v=e[:, :2], k_cache=kc, v_cache=vc,
                       slot_mapping=pos[:0])
    assert torch.equal(kc, kc0)


@pytest.mark.parametrize("why", ["no_interpreter", "fp64_cache"])
def test_fused_kv_reference_fallback(why, monkeypatch):
    """Where the kernel does not run: the reference, then write_kv, give the definition."""
    cache_dtype = torch.float64 if why == "fp64_cache" else torch.float32
    if why == "no_interpreter":
        monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(rt, "qk_norm_rope_triton", lambda *a, **kw: pytest.fail("kernel ran"))
    _, q, k, v, pos, cos, sin, qw, kw, kc, vc, slots = _case(5, 4, 2, 16, torch.float32,
                                                             cache_dtype, 34)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, kw)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    write_kv_ref(ref_k, v, ref_kc, ref_vc, slots)
    got_q, got_k = apply_qk_norm_rope(q, k, pos, cos, sin, qw, kw, v=v, k_cache=kc, v_cache=vc,
                                      slot_mapping=slots)
    assert got_q is q and got_k is k
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


def test_fused_kv_bad_inputs():
    _, q, k, v, pos, cos, sin, qw, kw, kc, vc, slots = _case(2, 4, 2, 16, torch.float32,
                                                             torch.float32, 35)
    full = dict(v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    for fn in (apply_qk_norm_rope, rt.qk_norm_rope_triton):
        for missing in full:
            partial = {n: x for n, x in full.items() if n != missing}
            with pytest.raises(ValueError, match="all or none"):
                fn(q, k, pos, cos, sin, qw, kw, **partial)
        with pytest.raises(ValueError, match="all or none"):
            fn(q, k, pos, cos, sin, v=v)
        with pytest.raises(ValueError, match="must both be"):  # v not k's shape
            fn(q, k, pos, cos, sin, **{**full, "v": v[:, :1]})
        with pytest.raises(ValueError, match="caches"):  # wrong head count
            fn(q, k, pos, cos, sin, **{**full, "k_cache": kc[:, :, :1], "v_cache": vc[:, :, :1]})
        with pytest.raises(ValueError, match="caches"):  # k_cache and v_cache disagree
            fn(q, k, pos, cos, sin, **{**full, "v_cache": vc[:2]})
        with pytest.raises(ValueError, match="caches"):  # not [NB, BS, Hkv, D]
            fn(q, k, pos, cos, sin, **{**full, "k_cache": kc[0], "v_cache": vc[0]})
        with pytest.raises(ValueError, match="slot_mapping"):
            fn(q, k, pos, cos, sin, **{**full, "slot_mapping": slots[:1]})
    with pytest.raises(ValueError, match="got only k_cache, v_cache"):  # names what was given
        apply_qk_norm_rope(q, k, pos, cos, sin, k_cache=kc, v_cache=vc)
    # The kernel wrapper also checks what only it cares about.
    with pytest.raises(ValueError, match="slot_mapping"):
        rt.qk_norm_rope_triton(q, k, pos, cos, sin, **{**full, "slot_mapping": slots.float()})
    with pytest.raises(ValueError, match="dtypes"):
        rt.qk_norm_rope_triton(q, k, pos, cos, sin,
                               **{**full, "k_cache": kc.double(), "v_cache": vc.double()})
    with pytest.raises(ValueError, match="contiguous last dim"):
        rt.qk_norm_rope_triton(q, k, pos, cos, sin,
                               **{**full, "v": v.transpose(1, 2).contiguous().transpose(1, 2)})
    # Nothing was written by any of the refused calls.
    assert torch.equal(kc, _case(2, 4, 2, 16, torch.float32, torch.float32, 35)[9])


# --------------------------------------------------------------------------- tiling
# A program takes BLOCK_R consecutive (token, head) rows of q or of k (never both); the tile is
# picked from the shapes on the host. These force small tiles on small shapes so that tiles
# straddle tokens, head counts are not multiples of the tile and the last tile runs past T.


def test_tile_choice():
    """Qwen3-30B-A3B (32 + 4 heads, D=128): 8 heads on 2 warps while decoding, 16 heads on 4
    warps for a long prefill; fewer, fatter programs than one per (token, head)."""
    assert rt.pick_tile(1 * 36, 64) == (8, 2)
    assert rt.pick_tile(256 * 36, 64) == (8, 2)
    assert rt.pick_tile(8192 * 36, 64) == (16, 4)
    assert rt.pick_tile(8192 * 36, 128) == (8, 4)  # D=256: as many elements per program
    assert rt.pick_tile(1, 8) == (32, 1)  # tiny heads: capped rows
    assert rt.pick_tile(10**6, 4096) == (1, 8)  # huge heads: one row, capped warps


def _gappy_case(t, hq, hkv, d, dtype, seed):
    """q, k, v as strided views of one buffer with gaps everywhere: every other token row (plus
    two spare rows past the last token), every other head slot, 8 leading dims before each
    head. Returns (base, q, k, v)."""
    g = torch.Generator().manual_seed(seed)
    h = hq + 2 * hkv
    base = torch.randn(2 * t + 2, h, 2, d + 8, generator=g).to(dtype)
    heads = base[:2 * t:2, :, 1, 8:]  # [T, H, D]: token stride 2*H*2*(D+8), head stride 2*(D+8)
    return base, heads[:, :hq], heads[:, hq:hq + hkv], heads[:, hq + hkv:]


@DTYPES
@pytest.mark.parametrize("block_r", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("shape", [(7, 6, 3, 32), (9, 5, 2, 24), (3, 1, 1, 16), (2, 12, 5, 8)],
                         ids=lambda s: "T{}Hq{}Hkv{}D{}".format(*s))
def test_tiled_fused_matches_ref(shape, block_r, dtype, monkeypatch):
    """Forced tiles over fused-qkv views (strided), padded slots, a cache of another dtype."""
    monkeypatch.setattr(rt, "pick_tile", lambda rows, half_p: (block_r, 1))
    _, q, k, v, pos, cos, sin, qw, kw, kc, vc, slots = _case(*shape, dtype, OTHER[dtype],
                                                             seed=sum(shape) + block_r,
                                                             nb=8, bs=4)
    _check_fused(q, k, v, pos, cos, sin, qw, kw, kc, vc, slots, dtype, rt.qk_norm_rope_triton)


@pytest.mark.parametrize("block_r", [2, 8, 32])
@pytest.mark.parametrize("weights", [True, False], ids=["qk_norm", "no_qk_norm"])
@pytest.mark.parametrize("kv", [True, False], ids=["fused_kv", "no_kv"])
def test_tiled_gappy_views(kv, weights, block_r, monkeypatch):
    """q, k, v with token and head strides unlike dense, int32 positions and slots: every
    element outside q and k (the gaps, v, the spare rows past T) stays bit for bit."""
    monkeypatch.setattr(rt, "pick_tile", lambda rows, half_p: (block_r, 1))
    t, hq, hkv, d = 5, 7, 3, 16
    base, q, k, v = _gappy_case(t, hq, hkv, d, torch.float32, seed=40 + block_r)
    *_, pos, cos, sin, qw, kw, kc, vc, slots = _case(t, hq, hkv, d, torch.float32,
                                                     torch.float32, seed=41, nb=4, bs=4)
    if not weights:
        qw = kw = None
    written = torch.zeros_like(base, dtype=torch.bool)
    written[:2 * t:2, :hq + hkv, 1, 8:] = True
    base0 = base.clone()
    if kv:
        _check_fused(q, k, v, pos.int(), cos, sin, qw, kw, kc, vc, slots.int(), torch.float32,
                     rt.qk_norm_rope_triton)
    else:
        ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, kw, 1e-6)
        rt.qk_norm_rope_triton(q, k, pos.int(), cos, sin, qw, kw, 1e-6)
        torch.testing.assert_close(q, ref_q, **TOL[torch.float32])
        torch.testing.assert_close(k, ref_k, **TOL[torch.float32])
    assert torch.equal(base[~written], base0[~written])


@pytest.mark.parametrize("regime", ["small", "large"])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_real_tiles_head_dim_128(t, regime, monkeypatch):
    """The tiles pick_tile really picks at D=128 (8 and 16 rows), with Hq=12 and Hkv=3 (not
    multiples of either), T=1 (the k tile mostly past T), all rows padded but two."""
    if regime == "large":
        monkeypatch.setattr(rt, "_LARGE_MIN_ROWS", 0)
    assert rt.pick_tile(t * 15, 64)[0] == (16 if regime == "large" else 8)
    _, q, k, v, pos, cos, sin, qw, kw, kc, vc, _ = _case(t, 12, 3, 128, torch.float16,
                                                         torch.float16, seed=50 + t, nb=8, bs=4)
    slots = torch.full((t,), -1)
    slots[0] = 9
    slots[-1] = 30 if t > 1 else 9
    _check_fused(q, k, v, pos, cos, sin, qw, kw, kc, vc, slots, torch.float16,
                 rt.qk_norm_rope_triton)


def test_tiled_q_or_k_without_heads(monkeypatch):
    """Hkv = 0 (no k programs) or Hq = 0 (only k programs): the other tensor alone is done."""
    monkeypatch.setattr(rt, "pick_tile", lambda rows, half_p: (4, 1))
    for hq, hkv in ((5, 0), (0, 3)):
        q, k = torch.randn(6, hq, 16), torch.randn(6, hkv, 16)
        pos = torch.randint(0, 64, (6,))
        cos, sin = build_rope_cache(16, 64, 10000.0)
        qw, kw = torch.rand(16) + 0.5, torch.rand(16) + 0.5
        ref_q, ref_k = apply_qk_norm_rope_ref(q, k, pos, cos, sin, qw, kw, 1e-6)
        rt.qk_norm_rope_triton(q, k, pos, cos, sin, qw, kw, 1e-6)
        torch.testing.assert_close(q, ref_q, **TOL[torch.float32])
        torch.testing.assert_close(k, ref_k, **TOL[torch.float32])


def test_per_step_ints_not_specialized(monkeypatch):
    """T and the k-program count vary per step: the compiled kernel must not specialize on them
    (== 1, multiple of 16), or a new class of T met mid-run would compile again. Checked on a
    private, non-interpreted copy of the module (defining kernels needs no GPU)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    spec = importlib.util.find_spec(f"{PKG}.rope")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not mod.INTERPRETED
    kernel = mod._qk_norm_rope_kernel
    assert {p.name for p in kernel.params if p.do_not_specialize} == {"num_k_programs",
                                                                       "num_tokens"}
