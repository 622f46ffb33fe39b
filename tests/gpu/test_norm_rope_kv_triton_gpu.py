"""RMSNorm, q/k-norm + rope and KV-write Triton kernels in bf16 on CUDA against the torch refs
(run on the same bf16 inputs, so both round at the same points) at Qwen3-30B-A3B shapes:
H=2048, Hq=32, Hkv=4, D=128, T in {1, 256}. Prints microseconds per call, kernel vs ref.

Tolerances:
- rms_norm / fused_add_rms_norm: the summed residual is one rounded add, so it must be exact;
  normed: max |err| <= 1e-2 * max |ref| (the float32 sum-of-squares order and rsqrt rounding
  differ from torch, which can move an element by one bf16 ulp).
- q/k norm + rope: max |err| <= 1e-2 * max |ref| (the same one-ulp moves, then rotated);
  the v third of the fused qkv buffer must be untouched.
- write_kv: exact (a copy; fp32 -> bf16 rounds to nearest even on both sides); slot -1 rows
  write nothing.
- q/k norm + rope with the KV write fused in: q, k and the K cache as q/k norm + rope against
  the refs; the caches exactly ``write_kv_ref`` of the kernel's own rotated k and v; rows not
  written (slot -1 padding, unused slots) untouched.
- CUDA-graph capture of the public entries (KV write separate or fused): replay with new
  inputs equals eager.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gpu_timing import cuda_ms

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

H, HQ, HKV, D = 2048, 32, 4, 128
NB, BS, MAX_POS = 512, 16, 4096
BF = torch.bfloat16


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _rel(got, ref):
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _time_us(fn, iters=100):
    return 1e3 * cuda_ms(fn, iters, warmup=5)


def _qkv(t, seed):
    """q, k, v as [T, H, D] views of one fused [T, (Hq + 2 Hkv) * D] bf16 projection output."""
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", generator=_gen(seed)).to(BF)
    q = qkv[:, :HQ * D].view(t, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
    return qkv, q, k, v


def _rope_inputs(t, seed):
    from epserve.kernels.rope import build_rope_cache

    cos, sin = build_rope_cache(D, MAX_POS, 1_000_000.0, device="cuda")
    g = _gen(seed + 1)
    positions = torch.randint(0, MAX_POS, (t,), device="cuda", generator=g)
    qw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(BF)
    kw = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(BF)
    return positions, cos, sin, qw, kw


@pytest.mark.parametrize("t", [1, 256])
def test_rms_norm_bf16(t):
    from epserve.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
    from epserve.kernels.triton.norm import fused_add_rms_norm_triton, rms_norm_triton

    g = _gen(t)
    x = torch.randn(t, H, device="cuda", generator=g).to(BF)
    res = torch.randn(t, H, device="cuda", generator=g).to(BF)
    w = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(BF)
    got = rms_norm_triton(x, w, 1e-6)
    rel = _rel(got, rms_norm_ref(x, w, 1e-6))
    normed, new_res = fused_add_rms_norm_triton(x, res, w, 1e-6)
    ref_normed, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    rel_fused = _rel(normed, ref_normed)
    print(f"rms_norm T={t}: rel {rel:.2e}; fused_add_rms_norm rel {rel_fused:.2e}")
    assert got.dtype == BF and rel <= 1e-2 and rel_fused <= 1e-2
    assert torch.equal(new_res, ref_res)


@pytest.mark.parametrize("t", [1, 256])
@pytest.mark.parametrize("weights", [True, False], ids=["qwen3", "no_qk_norm"])
def test_qk_norm_rope_bf16(t, weights):
    from epserve.kernels.rope import apply_qk_norm_rope_ref
    from epserve.kernels.triton.rope import qk_norm_rope_triton

    qkv, q, k, v = _qkv(t, seed=10 + t)
    positions, cos, sin, qw, kw = _rope_inputs(t, seed=t)
    if not weights:
        qw = kw = None
    v0 = v.clone()
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, positions, cos, sin, qw, kw, 1e-6)
    qk_norm_rope_triton(q, k, positions, cos, sin, qw, kw, 1e-6)
    rq, rk = _rel(q, ref_q), _rel(k, ref_k)
    print(f"qk_norm_rope T={t} weights={weights}: rel q {rq:.2e}, k {rk:.2e}")
    assert rq <= 1e-2 and rk <= 1e-2
    assert torch.equal(v, v0)


@pytest.mark.parametrize("t", [1, 256])
@pytest.mark.parametrize("weights", [True, False], ids=["qwen3", "no_qk_norm"])
def test_qk_norm_rope_fused_kv_write_bf16(t, weights):
    from epserve.kernels.kv_write import write_kv_ref
    from epserve.kernels.rope import apply_qk_norm_rope, apply_qk_norm_rope_ref

    _, q, k, v = _qkv(t, seed=80 + t)
    positions, cos, sin, qw, kw = _rope_inputs(t, seed=90 + t)
    if not weights:
        qw = kw = None
    g = _gen(100 + t)
    kc = torch.randn(NB, BS, HKV, D, device="cuda", generator=g).to(BF)
    vc = torch.randn(NB, BS, HKV, D, device="cuda", generator=g).to(BF)
    slots = torch.randperm(NB * BS, device="cuda", generator=g)[:t]
    slots[::3] = -1  # padded rows (row 0 included, so T=1 is all padding)
    v0, kc0, vc0 = v.clone(), kc.clone(), vc.clone()
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, positions, cos, sin, qw, kw, 1e-6)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    write_kv_ref(ref_k, v, ref_kc, ref_vc, slots)
    apply_qk_norm_rope(q, k, positions, cos, sin, qw, kw, 1e-6, v=v, k_cache=kc, v_cache=vc,
                       slot_mapping=slots)  # CUDA: the Triton kernel, one launch
    rq, rk, rkc = _rel(q, ref_q), _rel(k, ref_k), _rel(kc, ref_kc)
    print(f"qk_norm_rope+kv T={t} weights={weights}: rel q {rq:.2e}, k {rk:.2e}, "
          f"k_cache {rkc:.2e}")
    assert rq <= 1e-2 and rk <= 1e-2 and rkc <= 1e-2
    assert torch.equal(v, v0) and torch.equal(vc, ref_vc)
    own_kc = kc0.clone()
    write_kv_ref(k, v, own_kc, vc0, slots)
    assert torch.equal(kc, own_kc)
    untouched = torch.ones(NB * BS, dtype=torch.bool, device="cuda")
    untouched[slots[slots >= 0]] = False
    assert torch.equal(kc.view(-1, HKV, D)[untouched], kc0.view(-1, HKV, D)[untouched])


@pytest.mark.parametrize("t", [1, 256])
@pytest.mark.parametrize("src", [BF, torch.float32], ids=["bf16", "fp32"])
def test_write_kv_bf16_cache(t, src):
    from epserve.kernels.kv_write import write_kv_ref
    from epserve.kernels.triton.kv_write import write_kv_triton

    _, _, k, v = _qkv(t, seed=20 + t)
    k, v = k.to(src), v.to(src)
    g = _gen(30 + t)
    kc = torch.randn(NB, BS, HKV, D, device="cuda", generator=g).to(BF)
    vc = torch.randn(NB, BS, HKV, D, device="cuda", generator=g).to(BF)
    slots = torch.randperm(NB * BS, device="cuda", generator=g)[:t]
    slots[::3] = -1  # padded rows (row 0 included, so T=1 is all padding)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    write_kv_ref(k, v, ref_kc, ref_vc, slots)
    write_kv_triton(k, v, kc, vc, slots)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


@pytest.mark.parametrize("fused", [False, True], ids=["write_kv", "fused_kv"])
def test_cuda_graph_capture_and_replay(fused):
    """The public entries capture into one graph; replay with new positions/slots = eager."""
    from epserve.kernels.kv_write import write_kv
    from epserve.kernels.norm import fused_add_rms_norm
    from epserve.kernels.rope import apply_qk_norm_rope

    t = 8
    positions, cos, sin, qw, kw = _rope_inputs(t, seed=40)
    x = torch.randn(t, H, device="cuda", generator=_gen(41)).to(BF)
    res = torch.randn(t, H, device="cuda", generator=_gen(42)).to(BF)
    w = torch.ones(H, device="cuda", dtype=BF)
    qkv_in = torch.zeros(t, (HQ + 2 * HKV) * D, device="cuda", dtype=BF)
    slots = torch.arange(t, device="cuda")
    kc = torch.zeros(NB, BS, HKV, D, device="cuda", dtype=BF)
    vc = torch.zeros_like(kc)

    def step():
        normed, new_res = fused_add_rms_norm(x, res, w, 1e-6)
        qkv = qkv_in + normed[:, :1]  # stands in for the projection: a fresh buffer per step
        q = qkv[:, :HQ * D].view(t, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
        if fused:
            q, k = apply_qk_norm_rope(q, k, positions, cos, sin, qw, kw, 1e-6, v=v, k_cache=kc,
                                      v_cache=vc, slot_mapping=slots)
        else:
            q, k = apply_qk_norm_rope(q, k, positions, cos, sin, qw, kw, 1e-6)
            write_kv(k, v, kc, vc, slots)
        return new_res, q

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_res, g_q = step()

    qkv_in.normal_(generator=_gen(43))
    positions.copy_(torch.randint(0, MAX_POS, (t,), device="cuda", generator=_gen(44)))
    slots.copy_(torch.tensor([5, -1, 77, 300, -1, 1023, 2, 4000], device="cuda"))
    kc.zero_()
    vc.zero_()
    graph.replay()
    torch.cuda.synchronize()
    got = (g_res.clone(), g_q.clone(), kc.clone(), vc.clone())
    kc.zero_()
    vc.zero_()
    want_res, want_q = step()
    assert torch.equal(got[0], want_res) and torch.equal(got[1], want_q)
    assert torch.equal(got[2], kc) and torch.equal(got[3], vc)
    assert kc.view(-1, HKV, D).abs().sum((1, 2)).count_nonzero().item() <= 6


@pytest.mark.parametrize("t", [1, 256])
def test_timing(t):
    from epserve.kernels.kv_write import write_kv_ref
    from epserve.kernels.triton.kv_write import write_kv_triton
    from epserve.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
    from epserve.kernels.triton.norm import fused_add_rms_norm_triton, rms_norm_triton
    from epserve.kernels.rope import apply_qk_norm_rope_ref
    from epserve.kernels.triton.rope import qk_norm_rope_triton

    g = _gen(50 + t)
    x = torch.randn(t, H, device="cuda", generator=g).to(BF)
    res = torch.randn(t, H, device="cuda", generator=g).to(BF)
    w = torch.ones(H, device="cuda", dtype=BF)
    _, q, k, v = _qkv(t, seed=60 + t)
    positions, cos, sin, qw, kw = _rope_inputs(t, seed=70 + t)
    kc = torch.zeros(NB, BS, HKV, D, device="cuda", dtype=BF)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(NB * BS, device="cuda", generator=g)[:t]

    def fused_ref():
        _, rk = apply_qk_norm_rope_ref(q, k, positions, cos, sin, qw, kw)
        write_kv_ref(rk, v, kc, vc, slots)

    # What is timed is correct (on copies: the rope kernels work in place).
    assert _rel(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)) <= 1e-2
    (normed, new_res), (ref_normed, ref_res) = (fused_add_rms_norm_triton(x, res, w, 1e-6),
                                                fused_add_rms_norm_ref(x, res, w, 1e-6))
    assert _rel(normed, ref_normed) <= 1e-2 and torch.equal(new_res, ref_res)
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, positions, cos, sin, qw, kw)
    q2, k2 = q.clone(), k.clone()
    kc2, vc2, ref_kc, ref_vc = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    qk_norm_rope_triton(q2, k2, positions, cos, sin, qw, kw)
    assert _rel(q2, ref_q) <= 1e-2 and _rel(k2, ref_k) <= 1e-2
    write_kv_triton(k, v, kc2, vc2, slots)
    write_kv_ref(k, v, ref_kc, ref_vc, slots)
    assert torch.equal(kc2, ref_kc) and torch.equal(vc2, ref_vc)
    q2, k2 = q.clone(), k.clone()
    qk_norm_rope_triton(q2, k2, positions, cos, sin, qw, kw, v=v, k_cache=kc2, v_cache=vc2,
                        slot_mapping=slots)
    write_kv_ref(ref_k, v, ref_kc, ref_vc, slots)
    assert _rel(kc2, ref_kc) <= 1e-2 and torch.equal(vc2, ref_vc)

    cases = {
        "rms_norm": (lambda: rms_norm_triton(x, w, 1e-6), lambda: rms_norm_ref(x, w, 1e-6)),
        "fused_add_rms_norm": (lambda: fused_add_rms_norm_triton(x, res, w, 1e-6),
                               lambda: fused_add_rms_norm_ref(x, res, w, 1e-6)),
        "qk_norm_rope": (lambda: qk_norm_rope_triton(q, k, positions, cos, sin, qw, kw),
                         lambda: apply_qk_norm_rope_ref(q, k, positions, cos, sin, qw, kw)),
        "write_kv": (lambda: write_kv_triton(k, v, kc, vc, slots),
                     lambda: write_kv_ref(k, v, kc, vc, slots)),
        "qk_norm_rope+write_kv": (
            lambda: qk_norm_rope_triton(q, k, positions, cos, sin, qw, kw, v=v, k_cache=kc,
                                        v_cache=vc, slot_mapping=slots),
            fused_ref),
    }
    for name, (tri, ref) in cases.items():
        us_tri, us_ref = _time_us(tri), _time_us(ref)
        print(f"{name} T={t} bf16: triton {us_tri:.1f} us, ref {us_ref:.1f} us, "
              f"speedup {us_ref / us_tri:.1f}x")


@pytest.mark.parametrize("t", [1, 256, 8192])
def test_qk_norm_rope_kv_timing_prefill(t):
    """The fused q/k norm + rope + KV write at a decode and a prefill-sized step (T=8192: one
    layer of a long prefill). Checks the result against the refs, then prints microseconds per
    call with the tile in use and the bandwidth its bytes imply (q, k read and written, v read,
    both cache rows written; ~176 MB at T=8192, ~45 us at 4 TB/s)."""
    from epserve.kernels.kv_write import write_kv_ref
    from epserve.kernels.rope import apply_qk_norm_rope_ref
    from epserve.kernels.triton.rope import pick_tile, qk_norm_rope_triton

    _, q, k, v = _qkv(t, seed=110 + t)
    positions, cos, sin, qw, kw = _rope_inputs(t, seed=120 + t)
    kc = torch.zeros(NB, BS, HKV, D, device="cuda", dtype=BF)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(NB * BS, device="cuda", generator=_gen(130 + t))[:t]
    ref_q, ref_k = apply_qk_norm_rope_ref(q, k, positions, cos, sin, qw, kw, 1e-6)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    write_kv_ref(ref_k, v, ref_kc, ref_vc, slots)

    def call():
        qk_norm_rope_triton(q, k, positions, cos, sin, qw, kw, 1e-6, v=v, k_cache=kc,
                            v_cache=vc, slot_mapping=slots)

    call()
    assert _rel(q, ref_q) <= 1e-2 and _rel(k, ref_k) <= 1e-2 and _rel(kc, ref_kc) <= 1e-2
    assert torch.equal(vc, ref_vc)
    us = _time_us(call, iters=50)  # in place: later calls rotate again, same traffic
    mbytes = t * (2 * (HQ + HKV) + 3 * HKV) * D * 2 / 1e6
    block_r, warps = pick_tile(t * (HQ + HKV), D // 2)
    print(f"qk_norm_rope+write_kv T={t} bf16 ({block_r} rows x {warps} warps per program): "
          f"{us:.1f} us, {mbytes:.1f} MB, {mbytes / us:.2f} TB/s")
