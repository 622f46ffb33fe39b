"""The gated-DeltaNet ops on CUDA (skipped without a GPU) against their torch references (fp32,
CPU): ``causal_conv_step`` and ``gated_delta_step`` over per-slot state pools.

- A decode step runs our Triton kernels through the slots: random pools, shuffled slots, fresh
  sequences (their slot's garbage never read), padded rows at the spare slot (no other slot
  changes), at the Qwen3.5-35B-A3B shape (Hk 16, Hv 32, D 128, K 4) and smaller, odd ones.
- A prefill runs fla-core's chunked kernels (skipped where fla-core is not installed; where a
  shape is not fla's, the reference runs): packed sequences of 1 to 300 tokens.
- Chunked prefill then decode carries both states: two prefill chunks and decode steps give
  one reference call over all the tokens.
- A decode step captured in a CUDA graph replays with new slots, fresh flags and inputs.
- The GatedDeltaNet layer on CUDA (bf16) follows the CPU fp32 layer through prefill and decode.

fla's kernels round q, k, the chunk states and the outputs to the input dtype (and their fp32
dots may run as tf32), so its results are compared by relative error over the whole tensor.
Prints microseconds per decode step (both kernels, CUDA graph) at batch 1 and 64.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                               reason="fla-core is not installed (pip install 'epserve[gpu]')")

DEV = "cuda"
SPARE = 0
# (Hk, Hv, Dk, Dv, K): Qwen3.5-35B-A3B, an Hv/Hk of 3 with fla-sized dims, a tiny odd one
SHAPES = [(16, 32, 128, 128, 4), (2, 6, 64, 32, 4), (2, 4, 8, 12, 3)]
IDS = ["qwen35", "gqa3", "tiny"]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def _step_inputs(t, shape, dtype, gen):
    """mixed [t, C] (the projection's conv channels, a strided view) and g, beta, as the layer
    makes them; conv weight [C, K]."""
    hk, hv, dk, dv, kw = shape
    c = 2 * hk * dk + hv * dv
    mixed = torch.randn(t, c + 3 * hv, device=DEV, generator=gen).to(dtype)[:, :c]
    weight = (torch.randn(c, kw, device=DEV, generator=gen) * 0.4).to(dtype)
    g = -torch.rand(t, hv, device=DEV, generator=gen) * 1.5
    beta = torch.rand(t, hv, device=DEV, generator=gen).to(dtype)
    return mixed, weight, g, beta


def _split(y, shape):
    """The conv output's q, k, v views."""
    hk, hv, dk, dv, _ = shape
    t = y.shape[0]
    return (y[:, :hk * dk].view(t, hk, dk), y[:, hk * dk:2 * hk * dk].view(t, hk, dk),
            y[:, 2 * hk * dk:].view(t, hv, dv))


def _pools(n, shape, conv_dtype, gen):
    hk, hv, dk, dv, kw = shape
    c = 2 * hk * dk + hv * dv
    conv = torch.randn(n, c, kw - 1, device=DEV, generator=gen).to(conv_dtype)
    rec = torch.randn(n, hv, dk, dv, device=DEV, generator=gen) * 0.2
    return conv, rec


def _run(mixed, weight, g, beta, conv, rec, slots, fresh, cu, decode, shape):
    from epserve.kernels.causal_conv import causal_conv_step
    from epserve.kernels.gated_delta import gated_delta_step

    y = causal_conv_step(mixed, weight, conv, slots, fresh, cu, decode)
    return y, gated_delta_step(*_split(y, shape), g, beta, rec, slots, fresh, cu, decode)


def _reference(mixed, weight, g, beta, conv, rec, slots, fresh, cu, decode, shape, y_in=None):
    """The same step by the references on CPU in fp32 from the pools ``conv``, ``rec`` (left
    as they are); returns y, o and the new pools. ``y_in``: the rule's input instead of the
    reference conv's output (the device's own y: each op is checked on its own inputs)."""
    from epserve.kernels.causal_conv import causal_conv1d_ref
    from epserve.kernels.gated_delta import chunked_ref, recurrent_ref

    conv, rec = conv.float().cpu().clone(), rec.float().cpu().clone()
    slots, fresh = slots.cpu(), fresh.cpu()
    c0 = conv[slots].masked_fill(fresh[:, None, None], 0)
    r0 = rec[slots].masked_fill(fresh[:, None, None, None], 0)
    y, c1 = causal_conv1d_ref(mixed.float().cpu(), weight.float().cpu(), c0, cu)
    rule = recurrent_ref if decode else chunked_ref
    y_rule = y if y_in is None else y_in.float().cpu()
    o, r1 = rule(*_split(y_rule, shape), g.float().cpu(), beta.float().cpu(), r0, cu)
    conv[slots], rec[slots] = c1, r1
    return y, o, conv, rec


def _decode_slots(s, n, gen):
    """s rows: s - 2 real sequences on shuffled distinct slots (every third fresh), then two
    padded rows at the spare slot (fresh)."""
    slots = torch.randperm(n - 1, device=DEV, generator=gen)[:s] + 1
    slots[-2:] = SPARE
    fresh = torch.arange(s, device=DEV) % 3 == 1
    fresh[-2:] = True
    return slots, fresh


def _others(pool, slots):
    """The pool's slots but the spare (padded rows may write it)."""
    keep = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    keep[SPARE] = False
    return pool[keep]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_decode_step_matches_the_references(shape, dtype):
    gen = torch.Generator(device=DEV).manual_seed(1)
    s, n = 12, 20
    mixed, weight, g, beta = _step_inputs(s, shape, dtype, gen)
    conv, rec = _pools(n, shape, dtype, gen)
    slots, fresh = _decode_slots(s, n, gen)
    cu = tuple(range(s + 1))
    conv0, rec0 = conv.clone(), rec.clone()
    y, o = _run(mixed, weight, g, beta, conv, rec, slots, fresh, cu, True, shape)
    want = _reference(mixed, weight, g, beta, conv0, rec0, slots, fresh, cu, True, shape, y)
    tol = 2e-5 if dtype == torch.float32 else 8e-3
    assert _rel(y, want[0]) < tol and _rel(o, want[1]) < tol
    assert _rel(_others(conv, slots), _others(want[2], slots)) < tol
    assert _rel(_others(rec, slots), _others(want[3], slots)) < 1e-5
    untouched = torch.ones(n, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.equal(conv[untouched], conv0[untouched])
    assert torch.equal(rec[untouched], rec0[untouched])


def _prefill_case(lens, shape, dtype, seed, n=12):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(lens)
    mixed, weight, g, beta = _step_inputs(t, shape, dtype, gen)
    conv, rec = _pools(n, shape, dtype, gen)
    slots = torch.randperm(n - 1, device=DEV, generator=gen)[:len(lens)] + 1
    fresh = torch.arange(len(lens), device=DEV) % 2 == 0
    cu = [0]
    for m in lens:
        cu.append(cu[-1] + m)
    return mixed, weight, g, beta, conv, rec, slots, fresh, tuple(cu)


@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_prefill_runs_fla_and_matches_the_references(shape, dtype):
    from epserve.kernels.dispatch import fla_function

    lens = [1, 7, 64, 100, 300]
    case = _prefill_case(lens, shape, dtype, seed=2)
    assert fla_function(case[0], "fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    before = case[4].clone(), case[5].clone()
    y, o = _run(*case, False, shape)
    want = _reference(*case[:4], *before, *case[6:], False, shape, y)
    tol = 1e-2 if dtype == torch.float32 else 2e-2
    conv, rec = case[4], case[5]
    assert _rel(y, want[0]) < tol
    assert _rel(o, want[1]) < tol, _rel(o, want[1])
    assert _rel(conv, want[2]) < tol
    assert _rel(rec, want[3]) < tol, _rel(rec, want[3])


@pytest.mark.parametrize("shape", SHAPES[:2], ids=IDS[:2])
def test_chunked_prefill_then_decode_carries_the_state(shape):
    """Three sequences: prefill chunks of (70, 5, 130) then (40, 64, 1) tokens, then four
    decode steps, against one reference call over all 301 tokens from the same states."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    total = [70 + 40 + 4, 5 + 64 + 4, 130 + 1 + 4]
    seqs = [_step_inputs(m, shape, torch.bfloat16, gen) for m in total]
    weight = seqs[0][1]
    conv, rec = _pools(6, shape, torch.bfloat16, gen)
    slots = torch.tensor([4, 1, 5], device=DEV)
    parts = [(70, 5, 130), (40, 64, 1)] + [(1, 1, 1)] * 4
    outs, at = [[], [], []], [0, 0, 0]
    want_in = _reference_inputs(seqs, conv, rec, slots)
    for step, lens in enumerate(parts):
        fresh = torch.tensor([step == 0, False, step == 0], device=DEV)
        cu = tuple([0, lens[0], lens[0] + lens[1], sum(lens)])
        mixed, g, beta = (torch.cat([seqs[i][j][at[i]:at[i] + lens[i]] for i in range(3)])
                          for j in (0, 2, 3))
        _, o = _run(mixed, weight, g, beta, conv, rec, slots, fresh, cu,
                    lens == (1, 1, 1), shape)
        for i, part in enumerate(o.split(lens)):
            outs[i].append(part)
            at[i] += lens[i]
    got = torch.cat([torch.cat(x) for x in outs])
    want = _reference(*want_in, False, shape)
    assert _rel(got, want[1]) < 2e-2
    assert _rel(rec[slots], want[3][slots.cpu()]) < 2e-2
    assert _rel(conv[slots], want[2][slots.cpu()]) < 1e-2


def _reference_inputs(seqs, conv, rec, slots):
    """All of each sequence's tokens in one step, from the pools as they are now (the first
    and last sequence start fresh)."""
    mixed, g, beta = (torch.cat([s[j] for s in seqs]) for j in (0, 2, 3))
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + s[0].shape[0])
    fresh = torch.tensor([True, False, True], device=DEV)
    return mixed, seqs[0][1], g, beta, conv.clone(), rec.clone(), slots, fresh, tuple(cu)


def test_decode_step_replays_in_a_cuda_graph_with_new_slots():
    shape = SHAPES[0]
    gen = torch.Generator(device=DEV).manual_seed(4)
    s, n = 8, 16
    mixed, weight, g, beta = _step_inputs(s, shape, torch.bfloat16, gen)
    conv, rec = _pools(n, shape, torch.bfloat16, gen)
    slots, fresh = _decode_slots(s, n, gen)
    cu = tuple(range(s + 1))
    saved = conv.clone(), rec.clone()
    _run(mixed, weight, g, beta, conv, rec, slots, fresh, cu, True, shape)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, o = _run(mixed, weight, g, beta, conv, rec, slots, fresh, cu, True, shape)
    conv.copy_(saved[0])
    rec.copy_(saved[1])
    for step in range(3):  # new inputs, slots and fresh flags each replay; pools carry over
        new = _step_inputs(s, shape, torch.bfloat16, gen)
        new_slots, new_fresh = _decode_slots(s, n, gen)
        if step == 2:
            new_fresh[:] = False
            new_fresh[-2:] = True
        for dst, src in ((mixed, new[0]), (g, new[2]), (beta, new[3]), (slots, new_slots),
                         (fresh, new_fresh)):
            dst.copy_(src)
        before = conv.clone(), rec.clone()
        graph.replay()
        torch.cuda.synchronize()
        want = _reference(mixed, weight, g, beta, *before, slots, fresh, cu, True, shape, y)
        assert _rel(y, want[0]) < 8e-3 and _rel(o, want[1]) < 8e-3
        assert _rel(_others(rec, slots), _others(want[3], slots)) < 1e-5
        assert _rel(_others(conv, slots), _others(want[2], slots)) < 8e-3


def test_layer_on_cuda_follows_the_cpu_layer():
    """A GatedDeltaNet layer (Qwen3.5 head layout, hidden 256) in bf16 on CUDA and in fp32 on
    CPU: a prefill of two prompts (one continuing a state), then three decode steps."""
    from epserve.kernels.attention import AttentionMetadata
    from epserve.models.config import ModelConfig
    from epserve.models.gated_deltanet import GatedDeltaNet

    cfg = ModelConfig(architecture="Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text",
                      vocab_size=64, hidden_size=256, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=4096, num_experts=2, top_k=1,
                      moe_intermediate_size=32, intermediate_size=64,
                      layer_types=("linear_attention",), linear_num_key_heads=4,
                      linear_num_value_heads=8, linear_key_head_dim=64,
                      linear_value_head_dim=64, linear_conv_kernel_dim=4)
    torch.manual_seed(5)
    cpu = GatedDeltaNet(cfg)
    with torch.no_grad():
        for p in cpu.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.05))
        cpu.A_log.copy_(torch.rand(cfg.linear_num_value_heads).log())
    gpu = GatedDeltaNet(cfg).to(DEV, torch.bfloat16)
    gpu.load_state_dict(cpu.state_dict())
    spec = cpu.cache_spec()
    states = {d: (torch.randn(4, *spec.conv_shape, device=d) * 0.3,
                  torch.randn(4, *spec.recurrent_shape, device=d) * 0.1) for d in ("cpu", DEV)}
    states[DEV] = (states[DEV][0].bfloat16(), states[DEV][1])
    states[DEV][0].copy_(states["cpu"][0])
    states[DEV][1].copy_(states["cpu"][1])
    lens, seq_lens = [90, 37], [90, 37 + 20]  # sequence 1 continues its slot's state
    x = torch.randn(sum(lens) + 6, cfg.hidden_size)
    steps = [(x[:127], (0, 90, 127), tuple(seq_lens))]
    for i in range(3):
        steps.append((x[127 + 2 * i:129 + 2 * i], (0, 1, 2),
                      (seq_lens[0] + i + 1, seq_lens[1] + i + 1)))
    slots = {d: torch.tensor([2, 3], device=d) for d in ("cpu", DEV)}
    for rows, qsl, sl in steps:
        outs = {}
        for d, layer in (("cpu", cpu), (DEV, gpu)):
            meta = AttentionMetadata(
                slot_mapping=torch.full((rows.shape[0],), -1, device=d), query_start_loc=qsl,
                seq_lens=sl, block_tables=torch.zeros(2, 1, dtype=torch.int32, device=d),
                block_size=16, state_slots=slots[d])
            with torch.no_grad():
                outs[d] = layer(None, rows.to(d, layer.in_proj.weight.dtype), states[d], meta)
        assert _rel(outs[DEV], outs["cpu"]) < 3e-2, _rel(outs[DEV], outs["cpu"])
    assert _rel(states[DEV][1][slots[DEV]], states["cpu"][1][slots["cpu"]]) < 3e-2


@pytest.mark.parametrize("batch", [1, 64])
def test_decode_step_timing(batch):
    from gpu_timing import cuda_ms

    shape = SHAPES[0]
    gen = torch.Generator(device=DEV).manual_seed(6)
    mixed, weight, g, beta = _step_inputs(batch, shape, torch.bfloat16, gen)
    conv, rec = _pools(batch + 1, shape, torch.bfloat16, gen)
    slots = torch.arange(1, batch + 1, device=DEV)
    fresh = torch.zeros(batch, dtype=torch.bool, device=DEV)
    cu = tuple(range(batch + 1))
    _run(mixed, weight, g, beta, conv, rec, slots, fresh, cu, True, shape)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(mixed, weight, g, beta, conv, rec, slots, fresh, cu, True, shape)
    us = cuda_ms(graph.replay, iters=200) * 1e3
    state_mb = batch * rec[0].numel() * 4 * 2 / 1e6  # read and written
    print(f"\ngated-DeltaNet decode step (conv update + rule), batch {batch}, Qwen3.5-35B-A3B "
          f"layer: {us:.1f} us per graph replay ({state_mb / us:.2f} TB/s of fp32 state)")
