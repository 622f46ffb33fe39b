"""The DeltaNet ops' varlen kernels on CUDA (a speculative verify's k + 1 tokens a sequence, a
fold's accepted prefix), at the Qwen3.5-35B-A3B shapes (16 key heads, 32 value heads, Dk = Dv =
128; 8,192 conv channels of width 4), against the torch references over the gathered states:
outputs and the written slots, held sequences' slots untouched, fp32 and bf16. And the cost
that made them: a verify-shaped step through ``gated_delta_step`` / ``causal_conv_step``
(4 sequences of up to 4 tokens, two held), microseconds per graph replay, against a decode
step per position, printed beside the chunked fla path it replaced (session 16: a whole
verify step cost ~150 ms on that path)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpu_timing import cuda_ms, graph_us

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

HK, HV, DK, DV, C, KW = 16, 32, 128, 128, 8192, 4
LENS, HELD = (4, 1, 3, 4), [0, 3]


def _case(dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t, s = sum(LENS), len(LENS)
    q = torch.randn(t, HK, DK, device="cuda", generator=g).to(dtype)
    k = torch.randn(t, HK, DK, device="cuda", generator=g).to(dtype)
    v = torch.randn(t, HV, DV, device="cuda", generator=g).to(dtype)
    gate = -torch.rand(t, HV, device="cuda", generator=g) * 2
    beta = torch.rand(t, HV, device="cuda", generator=g).to(dtype)
    pool = torch.randn(s + 3, HV, DK, DV, device="cuda", generator=g) * 0.2
    x = torch.randn(t, C, device="cuda", generator=g).to(dtype)
    w = torch.randn(C, KW, device="cuda", generator=g).to(dtype)
    conv_pool = torch.randn(s + 3, C, KW - 1, device="cuda", generator=g).to(dtype)
    slots = torch.randperm(s + 2, device="cuda", generator=g)[:s] + 1
    fresh = torch.tensor([False, True, False, False], device="cuda")
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    return (q, k, v, gate, beta), pool, (x, w), conv_pool, slots, fresh, cu


def _want(ref, args, pool, slots, fresh, cu):
    start = pool[slots].clone()
    start[fresh] = 0
    out, new = ref(*args, start, cu)
    want = pool.clone()
    keep = [i for i in range(len(LENS)) if i not in HELD]
    want[slots[keep]] = new[keep].to(pool.dtype)
    return out, want


def _rel(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen_rule_and_conv_match_the_references(dtype):
    from epserve.kernels.causal_conv import causal_conv1d_ref
    from epserve.kernels.dispatch import varlen_tensors
    from epserve.kernels.gated_delta import recurrent_ref
    from epserve.kernels.triton.causal_conv_update import causal_conv_varlen_triton
    from epserve.kernels.triton.gated_delta_decode import gated_delta_varlen_triton

    args, pool, (x, w), conv_pool, slots, fresh, cu = _case(dtype, seed=3)
    cu_t, hold = varlen_tensors(cu, HELD, x.device)
    want_o, want_pool = _want(recurrent_ref, args, pool, slots, fresh, cu)
    o = gated_delta_varlen_triton(*args, pool, slots, fresh, cu_t, hold)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(o, want_o) < tol and _rel(pool, want_pool) < 1e-5
    assert torch.equal(pool[slots[HELD]], want_pool[slots[HELD]])
    want_y, want_conv = _want(causal_conv1d_ref, (x, w), conv_pool, slots, fresh, cu)
    y = causal_conv_varlen_triton(x, w, conv_pool, slots, fresh, cu_t, hold)
    assert _rel(y, want_y) < tol
    assert torch.equal(conv_pool, want_conv)  # stored inputs: copied, not computed


def test_a_verify_shaped_step_timing():
    """Graph-replayed calls of the entries on a verify's shape (held sequences, the offsets and
    holds on the device, as a verify graph replays them): cheaper than one decode step per
    position (``max(LENS)`` replays of the decode kernels over one row a sequence), printed
    beside fla's chunked path (eager: it syncs with the host) where fla-core is installed."""
    import epserve.kernels.dispatch as dispatch
    from epserve.kernels.causal_conv import causal_conv_step
    from epserve.kernels.dispatch import varlen_tensors
    from epserve.kernels.gated_delta import gated_delta_step

    from epserve.kernels.gated_delta import recurrent_ref

    args, pool, (x, w), conv_pool, slots, fresh, cu = _case(torch.bfloat16, seed=4)
    dev = varlen_tensors(cu, HELD, x.device)
    want_o, want_pool = _want(recurrent_ref, args, pool, slots, fresh, cu)
    o = gated_delta_step(*args, pool, slots, fresh, tuple(cu), False, HELD)  # what is timed
    assert _rel(o, want_o) < 1e-2 and _rel(pool, want_pool) < 1e-5
    step = lambda: (causal_conv_step(x, w, conv_pool, slots, fresh, tuple(cu), False, HELD,  # noqa: E731
                                     dev),
                    gated_delta_step(*args, pool, slots, fresh, tuple(cu), False, HELD))
    varlen = graph_us(step)
    s = len(LENS)
    firsts = torch.tensor(cu[:-1], device="cuda")  # each sequence's first row (no copy in capture)
    one, x_one = [a[firsts] for a in args], x[firsts]
    decode = graph_us(lambda: (
        causal_conv_step(x_one, w, conv_pool, slots, fresh,
                         tuple(range(s + 1)), True),
        gated_delta_step(*one, pool, slots, fresh, tuple(range(s + 1)), True)))
    short, dispatch.MAX_SHORT_TOKENS = dispatch.MAX_SHORT_TOKENS, 0  # every step "long"
    try:
        chunked = 1e3 * cuda_ms(step, iters=50) if importlib.util.find_spec("fla") \
            else float("nan")
    finally:
        dispatch.MAX_SHORT_TOKENS = short
    print(f"\nverify-shaped conv + rule, {s} sequences of <= {max(LENS)} tokens: varlen kernels "
          f"{varlen:.1f} us a replay; a one-row-a-sequence decode step {decode:.1f} us; fla's "
          f"chunked path {chunked:.1f} us a call (eager)")
    assert varlen < max(LENS) * decode
