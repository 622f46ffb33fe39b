"""The gated delta rule over per-slot states: ``gated_delta_step`` on both paths (reference, and
the interpreted decode kernel) against ``recurrent_ref`` / ``chunked_ref`` over the gathered
states, and the Triton decode kernel itself (interpreter on CPU).

Each case has a pool of random states, shuffled slots, fresh sequences whose slot holds
garbage (never read), one padded row at the spare slot (only the sequences' slots change),
grouped key heads (Hv / Hk of 1, 2, 3) and head dims that are not powers of two. Both compute
in float32 (the kernel sums in another order): states agree to ~1e-6, bf16 outputs to one
bf16 ulp.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from kernel_interp import interpreted_modules, kernel_fixtures, needs_triton

from epserve.kernels.dispatch import fla_function
from epserve.kernels.gated_delta import chunked_ref, gated_delta_step, recurrent_ref

_NAMES = ("gated_delta_decode",)
_MODS = interpreted_modules(*_NAMES)
gdd, = _MODS
assert gdd is None or gdd.INTERPRETED
interpret, path = kernel_fixtures(_NAMES, _MODS)

SPARE = 0  # the pool's spare slot: padded rows name it
FP32 = dict(atol=2e-5, rtol=1e-4)


def _inputs(t, hk, hv, dk, dv, dtype, seed):
    """q, k [t, Hk, Dk] and v [t, Hv, Dv] as strided views of one row (as the layer's conv
    output), g <= 0, beta in (0, 1) (bf16 where the inputs are)."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(t, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q = mixed[:, :hk * dk].view(t, hk, dk)
    k = mixed[:, hk * dk:2 * hk * dk].view(t, hk, dk)
    v = mixed[:, 2 * hk * dk:].view(t, hv, dv)
    g = -torch.rand(t, hv, generator=gen) * 2
    beta = torch.rand(t, hv, generator=gen).to(dtype)
    return q, k, v, g, beta, gen


def _decode_case(s, hk, hv, dk, dv, dtype, seed, n_slots=9):
    q, k, v, g, beta, gen = _inputs(s, hk, hv, dk, dv, dtype, seed)
    pool = torch.randn(n_slots, hv, dk, dv, generator=gen) * 0.3
    slots = torch.randperm(n_slots - 1, generator=gen)[:s] + 1
    slots[-1] = SPARE
    fresh = torch.zeros(s, dtype=torch.bool)
    fresh[[i for i in (1, 3) if i < s]] = True
    fresh[-1] = True  # a padded row is a fresh one-token sequence
    return (q, k, v, g, beta), pool, slots, fresh


def _want(args, pool, slots, fresh, cu, rule=recurrent_ref):
    o, new = rule(*args, pool[slots].masked_fill(fresh[:, None, None, None], 0), cu)
    want_pool = pool.clone()
    want_pool[slots] = new
    return o, want_pool


def _check(o, want_o, pool, want_pool, dtype):
    tol = FP32 if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(o, want_o, **tol)
    assert o.dtype == dtype
    keep = torch.ones(pool.shape[0], dtype=torch.bool)
    keep[SPARE] = False  # the spare: anything
    torch.testing.assert_close(pool[keep], want_pool[keep], **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_step_reads_and_writes_only_its_slots(path, dtype):
    s = 5
    args, pool, slots, fresh = _decode_case(s, 2, 4, 8, 6, dtype, seed=1)
    want_o, want_pool = _want(args, pool, slots, fresh, list(range(s + 1)))
    o = gated_delta_step(*args, pool, slots, fresh, tuple(range(s + 1)), decode=True)
    _check(o, want_o, pool, want_pool, dtype)


def test_prefill_then_decode_steps_carry_the_state(path):
    """Two sequences (one fresh), a chunked prefill of 13 and 9 tokens, then three decode
    steps (interpreter path: the kernel) give one chunked reference call over all tokens."""
    hk, hv, dk, dv = 1, 2, 8, 4
    q, k, v, g, beta, gen = _inputs(2 * 16, hk, hv, dk, dv, torch.float32, seed=7)
    pool = torch.randn(4, hv, dk, dv, generator=gen) * 0.3
    start = pool[3].clone()
    slots = torch.tensor([2, 3])
    seqs = [[x[i * 16:(i + 1) * 16] for x in (q, k, v, g, beta)] for i in range(2)]
    lens = (13, 9)
    pre = [torch.cat([seqs[i][j][:lens[i]] for i in range(2)]) for j in range(5)]
    outs = [[o] for o in gated_delta_step(*pre, pool, slots, torch.tensor([True, False]),
                                          (0, 13, 22), decode=False).split(lens)]
    for step in range(3):
        one = [torch.stack([seqs[i][j][lens[i] + step] for i in range(2)]) for j in range(5)]
        o = gated_delta_step(*one, pool, slots, torch.zeros(2, dtype=torch.bool), (0, 1, 2),
                             decode=True)
        outs[0].append(o[:1])
        outs[1].append(o[1:])
    got = torch.cat([torch.cat(outs[0]), torch.cat(outs[1])])
    whole = [torch.cat([seqs[i][j][:lens[i] + 3] for i in range(2)]) for j in range(5)]
    state0 = torch.stack([torch.zeros(hv, dk, dv), start])
    want_o, want_state = chunked_ref(*whole, state0, [0, 16, 28], chunk=8)
    torch.testing.assert_close(got, want_o, **FP32)
    torch.testing.assert_close(pool[slots], want_state, **FP32)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 16), (1, 3, 12, 20), (2, 4, 32, 8)],
                         ids=lambda v: str(v))
def test_decode_kernel_matches_ref(hk, hv, dk, dv, dtype, interpret):
    s = 4
    args, pool, slots, fresh = _decode_case(s, hk, hv, dk, dv, dtype, seed=hv * dk + dv)
    want_o, want_pool = _want(args, pool, slots, fresh, list(range(s + 1)))
    o = gdd.gated_delta_decode_triton(*args, pool, slots, fresh)
    _check(o, want_o, pool, want_pool, dtype)


def _varlen_case(lens, dtype, seed, hk=1, hv=2, dk=12, dv=20):
    """Sequences of ``lens`` tokens at shuffled slots (the second fresh), their rows packed."""
    q, k, v, g, beta, gen = _inputs(sum(lens), hk, hv, dk, dv, dtype, seed)
    pool = torch.randn(len(lens) + 3, hv, dk, dv, generator=gen) * 0.3
    slots = torch.randperm(len(lens) + 2, generator=gen)[:len(lens)] + 1
    fresh = torch.zeros(len(lens), dtype=torch.bool)
    fresh[1] = True
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return (q, k, v, g, beta), pool, slots, fresh, cu


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen_kernel_runs_each_sequences_rows_in_order_and_holds(dtype, interpret):
    """A verify's shape: sequences of 1 to 5 rows in one launch; the held ones' slots keep
    the state before the step, the others' take the reference's after their rows."""
    lens, held = (3, 1, 5, 2, 4), [0, 3]
    args, pool, slots, fresh, cu = _varlen_case(lens, dtype, seed=11)
    want_o, want_pool = _want(args, pool, slots, fresh, cu)
    want_pool[slots[held]] = pool[slots[held]]
    hold = torch.zeros(len(lens), dtype=torch.bool)
    hold[held] = True
    o = gdd.gated_delta_varlen_triton(*args, pool, slots, fresh, torch.tensor(cu), hold)
    _check(o, want_o, pool, want_pool, dtype)


def test_a_short_step_takes_the_varlen_kernel_and_holds(path, monkeypatch):
    """``gated_delta_step`` on a verify-shaped step (a few rows a sequence, some held): the
    reference's outputs and states on either path; on the interpreter path no chunked rule
    runs (the varlen kernel does)."""
    import epserve.kernels.gated_delta as gd

    lens, held = (4, 2, 3), (2,)
    args, pool, slots, fresh, cu = _varlen_case(lens, torch.float32, seed=12, hk=2, hv=4,
                                                dk=8, dv=6)
    want_o, want_pool = _want(args, pool, slots, fresh, cu, rule=chunked_ref)
    want_pool[slots[list(held)]] = pool[slots[list(held)]]
    if path == "interpreter":
        monkeypatch.setattr(gd, "chunked_ref", None)  # the kernel, or this fails
    o = gated_delta_step(*args, pool, slots, fresh, tuple(cu), decode=False, hold=held)
    _check(o, want_o, pool, want_pool, torch.float32)


@needs_triton
def test_decode_kernel_errors(interpret):
    (q, k, v, g, beta), pool, slots, fresh = _decode_case(3, 1, 2, 8, 4, torch.float32, seed=3)
    with pytest.raises(ValueError, match="value heads over"):
        gdd.gated_delta_decode_triton(q, k, v, g[:, :1], beta, pool, slots, fresh)
    with pytest.raises(ValueError, match="state pool"):
        gdd.gated_delta_decode_triton(q, k, v, g, beta, pool[..., :3], slots, fresh)
    with pytest.raises(ValueError, match="slots"):
        gdd.gated_delta_decode_triton(q, k, v, g, beta, pool, slots[:, None], fresh)
    with pytest.raises(ValueError, match="fresh"):
        gdd.gated_delta_decode_triton(q, k, v, g, beta, pool, slots, fresh.long())
    with pytest.raises(ValueError, match="dtypes"):
        gdd.gated_delta_decode_triton(q.double(), k, v, g, beta, pool, slots, fresh)
    with pytest.raises(ValueError, match="contiguous last dim"):
        gdd.gated_delta_decode_triton(q, k, v, g, beta, pool.transpose(2, 3).contiguous()
                                      .transpose(2, 3), slots, fresh)
    empty = gdd.gated_delta_decode_triton(q[:0], k[:0], v[:0], g[:0], beta[:0], pool,
                                          slots[:0], fresh[:0])
    assert empty.shape == (0, 2, 4)
    with pytest.raises(ValueError, match="cu"):
        gdd.gated_delta_varlen_triton(q, k, v, g, beta, pool, slots, fresh, torch.tensor([0, 3]),
                                      torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="hold"):
        gdd.gated_delta_varlen_triton(q, k, v, g, beta, pool, slots, fresh,
                                      torch.tensor([0, 1, 2, 3]), torch.zeros(3))


def test_step_errors():
    args, pool, slots, fresh = _decode_case(3, 1, 2, 8, 4, torch.float32, seed=3)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_step(*args, pool, slots, fresh, (0, 3), decode=False)
    with pytest.raises(ValueError, match="rows for"):
        gated_delta_step(*(x[:2] for x in args), pool, slots, fresh, (0, 1, 2, 2), decode=True)
    with pytest.raises(ValueError, match="state pool"):
        gated_delta_step(*args, pool[:, :1], slots, fresh, (0, 1, 2, 3), decode=True)


def test_fla_is_only_asked_for_on_cuda_outside_the_interpreter(monkeypatch):
    """Importing fla breaks the Triton interpreter in the process: CPU tensors and interpreted
    runs never import it; where it is missing the entry gets None (the reference runs)."""
    cuda_like = SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert fla_function(torch.zeros(1), "fla.ops.gated_delta_rule", "chunk_gated_delta_rule") \
        is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fla_function(cuda_like, "fla.ops.gated_delta_rule", "chunk_gated_delta_rule") is None
    assert "fla" not in sys.modules
    monkeypatch.delenv("TRITON_INTERPRET")
    assert fla_function(cuda_like, "epserve_test_no_such_fla.ops", "rule") is None
