"""Counter-based sampling noise and the Gumbel-max draw: the torch reference, the Triton kernel
(run in the Triton interpreter on CPU) bit for bit against it, and sample_rows' properties when
it dispatches to the kernel.

The kernel module is imported in the interpreter (kernel_interp.py); the ``interpret`` fixture
puts it in sys.modules and sets TRITON_INTERPRET=1 while the kernel tests run (triton reads it
at launch; sample_rows dispatches on it); other modules keep the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_interp import HAS_TRITON, interpreted_modules, needs_triton, use_interpreted

from epserve.kernels import sampling_noise as sn
from epserve.models.traits import RowSampling
from epserve.worker.sampler import mix_seed, sample_rows

_NAMES = ("sampling_noise",)
_MODS = interpreted_modules(*_NAMES)
st, = _MODS
KEYS = [0, 1, -1, 0x0123456789ABCDEF, -(2 ** 63), 2 ** 63 - 1, 0xDEADBEEF, -(2 ** 32)]
M32 = 0xFFFFFFFF


@pytest.fixture
def interpret(monkeypatch):
    use_interpreted(monkeypatch, _NAMES, _MODS)


def _as_int64(u: int) -> int:
    """The int64 with the bits of the uint64 ``u`` (how the sampler ships a key)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _mix32_int(x: int) -> int:
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & M32
    x ^= x >> 12
    x = (x * 0x297A2D39) & M32
    return x ^ (x >> 15)


def _hash_int(key: int, i: int) -> int:
    k = key & ((1 << 64) - 1)
    return _mix32_int(_mix32_int(i ^ (k & M32)) ^ (k >> 32))


def ids(tokens):
    return [t.token_id for t in tokens]


# ---------------------------------------------------------------------------- reference noise


def test_hash_matches_python_ints_and_known_values():
    keys = torch.tensor(KEYS, dtype=torch.int64)
    h = sn.noise_hash(keys, 300)
    assert h.dtype == torch.int64 and h.shape == (len(KEYS), 300)
    assert h.tolist() == [[_hash_int(k, i) for i in range(300)] for k in KEYS]
    # Pinned: a change here changes every seeded draw.
    assert h[3, :4].tolist() == [_hash_int(0x0123456789ABCDEF, i) for i in range(4)]
    pinned = [2235257115, 3854954068, 909755370]
    assert [_hash_int(0x0123456789ABCDEF, i) for i in range(3)] == pinned


def test_uniform_and_gumbel_are_exact_transforms():
    h = torch.tensor([0, 1, M32 - 1, M32, 2 ** 31], dtype=torch.int64)
    u = sn.uniform_from_hash(h)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert u.tolist() == [(v + 0.5) / 2 ** 32 for v in h.tolist()]
    g = sn.gumbel_from_hash(h)
    assert g.dtype == torch.float32
    want = [-math.log(-math.log((v + 0.5) / 2 ** 32)) for v in h.tolist()]
    assert g.tolist() == pytest.approx(want, rel=1e-6)
    assert math.isfinite(g.max().item()) and g.max().item() < 23.0


def test_noise_is_uniform_and_uncorrelated():
    keys = torch.tensor([_as_int64(mix_seed(7, j)) for j in range(64)], dtype=torch.int64)
    u = sn.uniform_from_hash(sn.noise_hash(keys, 4096))  # 262144 draws
    counts = torch.histc(u.float(), bins=64, min=0.0, max=1.0)
    e = u.numel() / 64
    chi2 = float(((counts - e) ** 2 / e).sum())
    assert chi2 < 120, chi2  # 63 dof: p ~ 1e-5 for a uniform source
    # Neighbouring ids, neighbouring output indices: correlation ~ N(0, 1/sqrt(n)).
    c = u - 0.5
    assert abs(float((c[:, 1:] * c[:, :-1]).mean() / c.var())) < 0.02
    assert abs(float((c[1:] * c[:-1]).mean() / c.var())) < 0.02
    g = sn.gumbel_from_hash(sn.noise_hash(keys, 4096))
    assert abs(float(g.double().mean()) - 0.5772) < 0.01  # Euler-Mascheroni


# ---------------------------------------------------------------------------- kernel vs reference


@needs_triton
@pytest.mark.parametrize("vocab,block", [(300, 64), (1000, 256), (17, 16)])
def test_kernel_noise_bits_equal_reference(interpret, vocab, block):
    keys = torch.tensor(KEYS, dtype=torch.int64)
    h, g = st.noise_triton(keys, vocab, block=block)
    assert torch.equal(h, sn.noise_hash(keys, vocab))
    assert torch.equal(g.view(torch.int32), sn.gumbel_noise(keys, vocab).view(torch.int32))


def _params(r, v, seed, nb=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, v, generator=g) * 3
    x[0, 5] = x[0, 9] = x[0].max() + 1  # a tie at the top
    keys = torch.randint(-2 ** 62, 2 ** 62, (r,), generator=g) * 2
    inv_t = torch.rand(r, generator=g) * 2 + 0.2
    noisy = (torch.arange(r) % 3 != 0).to(torch.int64)
    banned = torch.randint(-1, v, (r, nb), generator=g)
    thr = torch.full((r,), float("-inf"))
    tid = torch.full((r,), v, dtype=torch.int64)
    s = x * inv_t.unsqueeze(1)
    sn.apply_bans(s, banned)
    srt, order = torch.sort(s, dim=1, descending=True, stable=True)
    cut = torch.randint(1, 30, (r,), generator=g)
    for i in range(1, r, 2):  # every other row keeps a random prefix of its sorted order
        thr[i], tid[i] = srt[i, cut[i] - 1], order[i, cut[i] - 1]
    return x, keys, inv_t, noisy, thr, tid, banned


@needs_triton
@pytest.mark.parametrize("r,v,nb,block", [(12, 300, 3, 64), (7, 1000, 0, 256), (5, 40, 5, 16)])
def test_kernel_draw_equals_reference(interpret, r, v, nb, block):
    args = _params(r, v, seed=r * v + nb, nb=nb)
    want = sn.gumbel_argmax_ref(*args)
    assert torch.equal(st.gumbel_argmax_triton(*args, block=block), want)
    x = args[0]
    ties = x.clone()
    ties[:, : v // 2] = 0.0  # many equal logits; greedy rows take the lowest id
    args2 = (ties,) + args[1:]
    assert torch.equal(st.gumbel_argmax_triton(*args2, block=block), sn.gumbel_argmax_ref(*args2))
    # bf16 input is upcast in the kernel; a strided view is accepted.
    args3 = (x.bfloat16(),) + args[1:]
    assert torch.equal(st.gumbel_argmax_triton(*args3, block=block), sn.gumbel_argmax_ref(*args3))
    wide = torch.cat([x, x], dim=1)[:, :v]
    assert torch.equal(st.gumbel_argmax_triton(wide, *args[1:], block=block), want)


@needs_triton
def test_kernel_edge_rows(interpret):
    v = 40
    x = torch.randn(3, v)
    x[1] = float("-inf")  # nothing finite: torch.argmax's 0
    banned = torch.tensor([list(range(v)), [-1] * v, [-1] * v])  # row 0: everything banned
    args = (x, torch.tensor([1, 2, 3]), torch.ones(3), torch.tensor([1, 1, 0]),
            torch.full((3,), float("-inf")), torch.full((3,), v), banned)
    got = st.gumbel_argmax_triton(*args, block=16)
    assert got.tolist()[:2] == [0, 0] and torch.equal(got, sn.gumbel_argmax_ref(*args))
    with pytest.raises(ValueError, match="power of two"):
        st.gumbel_argmax_triton(*args, block=24)
    with pytest.raises(ValueError, match="keys"):
        st.gumbel_argmax_triton(x, torch.tensor([1, 2]), *args[2:])


def test_dispatch(monkeypatch, interpret):
    args = _params(4, 50, seed=1)
    calls = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if HAS_TRITON:
        real = st.gumbel_argmax_triton
        monkeypatch.setattr(st, "gumbel_argmax_triton",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = sn.gumbel_argmax(*args)
    assert not calls  # CPU without the interpreter: the reference
    if HAS_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert torch.equal(sn.gumbel_argmax(*args), ref) and calls == [1]


# ---------------------------------------------------------------------- sample_rows via the kernel


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 200, generator=g) * 3
    rows = [RowSampling(temperature=0.0),
            RowSampling(temperature=1.0, seed=3),
            RowSampling(temperature=0.7, seed=4, top_k=5),
            RowSampling(temperature=1.2, seed=5, top_p=0.8, banned_token_ids=(int(x[3].argmax()),)),
            RowSampling(temperature=0.9, seed=6, min_p=0.05, logprobs=3),
            RowSampling(temperature=0.0, banned_token_ids=(int(x[5].argmax()), 7, 900)),
            RowSampling(temperature=1.5, seed=7, top_k=20, top_p=0.9, min_p=0.01),
            RowSampling(temperature=2.0, seed=8, banned_token_ids=tuple(range(0, 200, 2)))]
    return x, rows, [0, 5, 1, 2, 9, 0, 4, 3]


@needs_triton
def test_sample_rows_same_tokens_on_kernel_and_reference(monkeypatch, interpret):
    x, rows, idx = _batch()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ref = sample_rows(x, rows, idx)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = sample_rows(x, rows, idx)
    assert ids(got) == ids(ref)
    assert got[4].logprob == pytest.approx(ref[4].logprob) and len(got[4].top) == 3
    assert ids(got)[0] == int(x[0].argmax()) and ids(got)[3] != int(x[3].argmax())
    assert ids(got)[7] % 2 == 1


@needs_triton
def test_sample_rows_order_and_company_independent(interpret):
    x, rows, idx = _batch(1)
    base = ids(sample_rows(x, rows, idx))
    perm = [6, 2, 7, 0, 4, 1, 5, 3]
    got = ids(sample_rows(x[perm], [rows[i] for i in perm], [idx[i] for i in perm]))
    assert got == [base[i] for i in perm]
    for i in (1, 3, 6):
        assert ids(sample_rows(x[i:i + 1], [rows[i]], [idx[i]])) == [base[i]]


@needs_triton
def test_sample_rows_frequencies_bans_and_extreme_filters(interpret):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 3.0])
    p = torch.softmax(logits[:5], 0).tolist()
    n = 500  # one interpreted program per draw; the reference path runs 4000 in test_sampler
    rows = [RowSampling(seed=11, banned_token_ids=(5,))] * n
    drawn = ids(sample_rows(logits.repeat(n, 1), rows, list(range(n))))
    assert 5 not in drawn
    chi2 = sum((drawn.count(i) - n * p[i]) ** 2 / (n * p[i]) for i in range(5))
    assert chi2 < 25  # 4 degrees of freedom: p < 1e-4 for a correct sampler
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    greedy = x.argmax(-1).tolist()
    for knob in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        rows = [RowSampling(temperature=2.0, seed=s, **knob) for s in range(16)]
        assert ids(sample_rows(x, rows, list(range(16)))) == greedy, knob
