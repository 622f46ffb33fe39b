"""The gated delta rule and the short causal convolution of gated-DeltaNet layers against
transformers' own torch forms (the oracle): packed sequences of different lengths, each from
its own state, grouped key heads, and a sequence split over calls that carry the state
(chunked prefill, then one-token decodes) giving the outputs of one call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epserve.kernels.causal_conv import causal_conv1d_ref
from epserve.kernels.gated_delta import chunked_ref, recurrent_ref

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

LENS = [1, 5, 17, 40]  # tokens per sequence; 17 and 40 cross chunk boundaries (chunk = 8)


def _inputs(hk: int, hv: int, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 2  # log decays <= 0
    beta = torch.rand(t, hv, generator=gen)
    state = torch.randn(len(LENS), hv, dk, dv, generator=gen) * 0.3
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    return q, k, v, g, beta, state, cu


def _oracle(q, k, v, g, beta, state, cu):
    """transformers' chunked form, one sequence at a time (batch of one)."""
    outs, states = [], []
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        o, st = hf.torch_chunk_gated_delta_rule(
            q[None, a:b], k[None, a:b], v[None, a:b], g=g[None, a:b], beta=beta[None, a:b],
            chunk_size=8, initial_state=state[s:s + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        states.append(st[0])
    return torch.cat(outs), torch.stack(states)


@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_the_rule_matches_transformers(hk, hv, form):
    args = _inputs(hk, hv)
    want_o, want_s = _oracle(*args)
    if form == "recurrent":
        got_o, got_s = recurrent_ref(*args)
    else:
        got_o, got_s = chunked_ref(*args, chunk=8)
    torch.testing.assert_close(got_o, want_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_s, want_s, atol=2e-5, rtol=1e-4)


def test_a_sequence_split_over_calls_gives_one_calls_outputs():
    q, k, v, g, beta, state, cu = _inputs(2, 4, seed=3)
    a, b = cu[3], cu[4]  # the 40-token sequence: 13 chunked, 19 chunked, then 8 one by one
    one = (x[a:b] for x in (q, k, v, g, beta))
    want_o, want_s = chunked_ref(*one, state[3:4], [0, b - a], chunk=8)
    outs, st, at = [], state[3:4], a
    for n in (13, 19) + (1,) * 8:
        part = [x[at:at + n] for x in (q, k, v, g, beta)]
        fn = recurrent_ref if n == 1 else chunked_ref
        o, st = fn(*part, st, [0, n])
        outs.append(o)
        at += n
    torch.testing.assert_close(torch.cat(outs), want_o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(st, want_s, atol=2e-5, rtol=1e-4)


def test_bad_shapes_are_refused():
    q, k, v, g, beta, state, cu = _inputs(2, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        recurrent_ref(q, k, v, g, beta, state, cu[:-1])
    with pytest.raises(ValueError, match="value heads over"):
        chunked_ref(q, k, v[:, :3], g[:, :3], beta[:, :3], state[:, :3], cu)


def test_the_causal_conv_matches_a_padded_convolution_and_carries_its_state():
    gen = torch.Generator().manual_seed(1)
    c, kw = 12, 4
    x = torch.randn(sum(LENS), c, generator=gen)
    w = torch.randn(c, kw, generator=gen)
    cu = [0]
    for n in LENS:
        cu.append(cu[-1] + n)
    zero = torch.zeros(len(LENS), c, kw - 1)
    got, new = causal_conv1d_ref(x, w, zero, cu)
    for s in range(len(LENS)):  # transformers' layer: Conv1d(padding=K-1), first n outputs
        xs = x[cu[s]:cu[s + 1]].T[None]
        want = F.silu(F.conv1d(xs, w[:, None, :], padding=kw - 1, groups=c)[..., :xs.shape[-1]])
        torch.testing.assert_close(got[cu[s]:cu[s + 1]], want[0].T)
        tail = F.pad(xs[0], (kw - 1, 0))[:, -(kw - 1):]
        torch.testing.assert_close(new[s], tail)
    a, b = cu[3], cu[4]  # split 40 tokens as 11, 1, 28: the state carries the history
    st, outs = zero[3:4], []
    for lo, hi in ((a, a + 11), (a + 11, a + 12), (a + 12, b)):
        o, st = causal_conv1d_ref(x[lo:hi], w, st, [0, hi - lo])
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), got[a:b])
    torch.testing.assert_close(st[0], new[3])
