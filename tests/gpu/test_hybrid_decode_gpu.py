"""The hybrids' decode path on CUDA (skipped without a GPU): how many kernels a decode step of
each token mixer launches, a CUDA graph of a few layers replayed with new lengths (fresh
sequences change between replays: the shared fresh mask is recomputed inside the graph), and
tiny Qwen3-Next / Qwen3.5-MoE checkpoints in fp32 on CUDA (decode steps replayed from CUDA
graphs) giving transformers' greedy tokens.

Launches per decode step at batch 1 (bf16, the Qwen3.5-35B-A3B layer shapes), counted with the
profiler:
- a zero-centred residual add + norm: 1 (was 11 torch ops);
- a GatedDeltaNet layer: in_proj GEMV, conv update, the rule (g and beta inside), the gated
  norm, out_proj GEMV = 5, plus one fresh mask per step (``seq_lens_t == 1``, shared by the
  step's layers) (was 25: g/beta 8 and the gated norm 12 in torch);
- a GatedAttention layer: qkvg GEMV, one launch for the zero-centred q/k norms, partial rope,
  KV write, attention and gate, o_proj GEMV = 3 (was ~47).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

BS = 16


def _cfg(hidden=2048, layers=("linear_attention",), **kw):
    """The Qwen3.5-35B-A3B layer shapes (smaller ``hidden`` / heads where given)."""
    from epserve.models.config import ModelConfig

    shape = dict(num_heads=16, num_kv_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128)
    shape.update(kw)
    return ModelConfig(architecture="Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text",
                       vocab_size=64, hidden_size=hidden, num_layers=len(layers),
                       rms_norm_eps=1e-6, rope_theta=1e7, max_position_embeddings=4096,
                       num_experts=2, top_k=1, moe_intermediate_size=32, intermediate_size=64,
                       layer_types=tuple(layers), partial_rotary_factor=0.25,
                       linear_conv_kernel_dim=4, **shape)


def _layers(cfg, seed=0):
    """(norm, mixer) per layer of ``cfg`` in bf16 on CUDA, random weights (norms around 0)."""
    from epserve.models.gated_attention import GatedAttention
    from epserve.models.gated_deltanet import GatedDeltaNet
    from epserve.models.layers import ZeroCentredRMSNorm

    torch.manual_seed(seed)
    out = []
    for i in range(cfg.num_layers):
        mixer = GatedDeltaNet(cfg) if cfg.is_linear_attention(i) else GatedAttention(cfg)
        norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        with torch.no_grad():
            for p in [*mixer.parameters(), *norm.parameters()]:
                p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02))
            if isinstance(mixer, GatedDeltaNet):
                mixer.A_log.copy_(torch.rand_like(mixer.A_log).log())
        out.append((norm.to("cuda", torch.bfloat16), mixer.to("cuda", torch.bfloat16)))
    return out


def _caches(cfg, layers, slots: int, blocks: int):
    from epserve.models.gated_deltanet import GatedDeltaNet

    caches = []
    for _, mixer in layers:
        if isinstance(mixer, GatedDeltaNet):
            spec = mixer.cache_spec()
            caches.append((torch.randn(slots, *spec.conv_shape, device="cuda").bfloat16() * 0.3,
                           torch.randn(slots, *spec.recurrent_shape, device="cuda") * 0.1))
        else:
            caches.append(tuple(torch.randn(blocks, BS, cfg.num_kv_heads, cfg.head_dim,
                                            device="cuda").bfloat16() for _ in range(2)))
    return caches


class _Step:
    """A decode step's device buffers (a CUDA graph's inputs) and its metadata."""

    def __init__(self, b: int, width: int, spare: int):
        self.pos = torch.zeros(b, dtype=torch.int64, device="cuda")
        self.slots = torch.full((b,), -1, dtype=torch.int64, device="cuda")
        self.tables = torch.zeros(b, width, dtype=torch.int32, device="cuda")
        self.lens = torch.ones(b, dtype=torch.int32, device="cuda")
        self.state_slots = torch.full((b,), spare, dtype=torch.int64, device="cuda")

    def meta(self):
        from epserve.kernels.attention import AttentionMetadata

        b = self.pos.shape[0]
        return AttentionMetadata(slot_mapping=self.slots, query_start_loc=tuple(range(b + 1)),
                                 seq_lens=(1,) * b, block_tables=self.tables, block_size=BS,
                                 seq_lens_t=self.lens, state_slots=self.state_slots)

    def set(self, lens, state_slots, tables):
        """Sequences of ``lens`` tokens (this step's is the last) at ``state_slots``."""
        b = len(lens)
        self.lens.copy_(torch.tensor(lens, dtype=torch.int32))
        self.pos.copy_(torch.tensor([n - 1 for n in lens]))
        self.state_slots.copy_(torch.tensor(state_slots))
        self.tables.copy_(tables)
        self.slots.copy_(torch.tensor([int(tables[i, (lens[i] - 1) // BS]) * BS
                                       + (lens[i] - 1) % BS for i in range(b)]))


def _forward(layers, caches, rope, x, res, step, meta=None):
    """Each layer's zero-centred residual add + norm, then its mixer (a decode step)."""
    meta = step.meta() if meta is None else meta
    h = x
    for (norm, mixer), cache in zip(layers, caches):
        normed, res = norm(h, res)
        h = mixer(step.pos, normed, cache, meta, rope)
    return h, res


def _rope(cfg):
    from epserve.models.layers import RotaryEmbedding

    return RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta).cuda()


def _kernels(fn) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


# A DeltaNet mixer: in_proj + conv, the recurrence, the gated norm, out_proj (the gated norm is
# not fused into out_proj: under programmatic dependent launch the fused kernel lost, 05564f9).
@pytest.mark.parametrize("kind,per_layer", [("linear_attention", 4), ("full_attention", 3)])
def test_decode_launches_per_layer(kind, per_layer):
    cfg = _cfg(layers=(kind, kind))
    layers = _layers(cfg)
    caches = _caches(cfg, layers, slots=4, blocks=8)
    rope = _rope(cfg)
    step = _Step(1, 4, spare=0)
    step.set([37], [2], torch.arange(4, dtype=torch.int32).view(1, 4))
    x = torch.randn(1, cfg.hidden_size, device="cuda").bfloat16()
    res = torch.randn_like(x)
    with torch.no_grad():
        names = _kernels(lambda: _forward(layers, caches, rope, x, res, step))
    fresh_mask = 1 if kind == "linear_attention" else 0  # once a step, shared by the layers
    print(f"\n{kind}: {len(names)} kernels for 2 layers (norm + mixer each): {names}")
    assert len(names) == 2 * (1 + per_layer) + fresh_mask, names


def test_decode_graph_replays_with_new_lengths_and_fresh_sequences():
    """DeltaNet, DeltaNet, gated attention (hidden 256, smaller heads), a graph of 4 rows
    captured as the runner does (two eager warm-ups of padding on the same metadata, then the
    capture), replayed twice with new lengths, slots and inputs (which sequences start fresh
    changes), each against an eager run of the same step from the same caches."""
    cfg = _cfg(hidden=256, layers=("linear_attention", "linear_attention", "full_attention"),
               num_heads=4, num_kv_heads=2, head_dim=64, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
    layers = _layers(cfg, seed=1)
    caches = _caches(cfg, layers, slots=6, blocks=24)
    rope = _rope(cfg)
    b, width, spare = 4, 4, 0
    step = _Step(b, width, spare)
    x = torch.zeros(b, cfg.hidden_size, device="cuda").bfloat16()
    res = torch.zeros_like(x)
    meta = step.meta()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                _forward(layers, caches, rope, x, res, step, meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _ = _forward(layers, caches, rope, x, res, step, meta)
    tables = torch.arange(b * width, dtype=torch.int32).view(b, width) + 4
    for lens, state_slots in (([5, 1, 40, 1], [1, 2, 3, 4]), ([6, 2, 1, 1], [1, 2, 3, spare])):
        step.set(lens, state_slots, tables)
        x.copy_(torch.randn_like(x, dtype=torch.float32))
        res.copy_(torch.randn_like(res, dtype=torch.float32))
        eager = [tuple(c.clone() for c in cache) for cache in caches]
        graph.replay()  # updates ``caches`` in place; the next replay continues from them
        with torch.no_grad():  # the same step eagerly from the same caches, a new metadata
            want, _ = _forward(layers, eager, rope, x, res, step)
        torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)
        for i, (got_c, want_c) in enumerate(zip(caches, eager)):
            for g, w in zip(got_c, want_c):
                torch.testing.assert_close(g.float(), w.float(), atol=1e-2, rtol=1e-2,
                                           msg=f"layer {i}")


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_fp32_hybrid_on_cuda_matches_transformers(arch, tmp_path, monkeypatch):
    """Decode steps on our kernels (CUDA graphs), the prefill on the torch references (fla off,
    so only the decode path is under test): transformers' greedy tokens and their logprobs."""
    import epserve.kernels.causal_conv as causal_conv
    import epserve.kernels.gated_delta as gated_delta
    from epserve import LLM, SamplingParams
    from oracle import hf_greedy
    from tiny_ckpt import make_tiny_checkpoint

    for mod in (causal_conv, gated_delta):
        monkeypatch.setattr(mod, "fla_function", lambda *a: None)
    ckpt = make_tiny_checkpoint(arch, tmp_path / arch)
    llm = LLM(model=str(ckpt), dtype="float32", device="cuda", num_kv_blocks=512)
    assert llm.model.runner.graphs is not None
    prompts = [[5, 9, 2, 44, 17], [3] * 11, list(range(20, 50, 3)), [7]]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    for p, o in zip(prompts, llm.generate([{"prompt_token_ids": q} for q in prompts], sp)):
        want, want_lps = hf_greedy(ckpt, p, 24)
        got = o.outputs[0]
        assert got.token_ids == want
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert lps == pytest.approx(want_lps, abs=1e-3)
