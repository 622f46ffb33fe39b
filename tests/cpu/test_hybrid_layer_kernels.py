"""The hybrids' token mixers on the Triton path (every kernel in the interpreter, on CPU) against
the same layers on the reference path (what a CPU run takes; the parity tests hold it to
transformers): a GatedDeltaNet layer and a GatedAttention layer (partial rotary 0.25,
zero-centred q/k norms, output gate) through a prefill of two sequences (or one) and decode
steps with device lengths (a CUDA graph's form: one fused launch per op; at one row the
DeltaNet's conv and gated norm inside its projections' launches), with the layer's norm before
it; and a held speculative verify on the DeltaNet layer, which still logs g and beta as
tensors and folds the accepted prefix in.

fp32 throughout: outputs, states and caches agree to float32 rounding (the kernels sum in
another order), so the tolerance is 1e-4.
"""

from __future__ import annotations

import pytest
from kernel_interp import HAS_TRITON, interpreted_modules, use_interpreted

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402

from epserve.kernels.attention import AttentionMetadata, StateRuns  # noqa: E402
from epserve.models.config import ModelConfig  # noqa: E402
from epserve.models.gated_attention import GatedAttention  # noqa: E402
from epserve.models.gated_deltanet import GatedDeltaNet, fold_runs  # noqa: E402
from epserve.models.layers import RotaryEmbedding, ZeroCentredRMSNorm  # noqa: E402

_NAMES = ("norm", "linear", "causal_conv_update", "gated_delta_decode", "rope", "rope_decode",
          "paged_attention", "paged_prefill", "kv_write", "deltanet_proj")
_MODS = interpreted_modules(*_NAMES)
TOL = dict(atol=1e-4, rtol=1e-4)
BS = 4


def _cfg(layer_type: str) -> ModelConfig:
    return ModelConfig(architecture="Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text",
                       vocab_size=64, hidden_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                       head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                       max_position_embeddings=64, num_experts=2, top_k=1,
                       moe_intermediate_size=8, intermediate_size=16, layer_types=(layer_type,),
                       partial_rotary_factor=0.25, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                       linear_conv_kernel_dim=4)


def _init(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():  # 1-D: norms (zero-centred: around 0), A_log, dt_bias
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 1 else 0.2))


def _steps(prompt_lens, decode_steps):
    """(rows, query_start_loc, seq_lens, decode) per step: one prefill of every sequence, then
    decode steps of one row each."""
    out = [(sum(prompt_lens), tuple([0, *torch.tensor(prompt_lens).cumsum(0).tolist()]),
            tuple(prompt_lens), False)]
    lens = list(prompt_lens)
    for _ in range(decode_steps):
        lens = [n + 1 for n in lens]
        out.append((len(lens), tuple(range(len(lens) + 1)), tuple(lens), True))
    return out


def _meta(qsl, seq_lens, decode, tables, slots, **kw):
    rows = [p for s, n in enumerate(seq_lens) for p in range(n - (qsl[s + 1] - qsl[s]), n)]
    slot_mapping = torch.tensor([int(tables[s, p // BS]) * BS + p % BS
                                 for s, n in enumerate(seq_lens)
                                 for p in range(n - (qsl[s + 1] - qsl[s]), n)])
    return AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=seq_lens,
                             block_tables=tables, block_size=BS,
                             seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32) if decode
                             else None, state_slots=slots, **kw), torch.tensor(rows)


_MOD = dict(zip(_NAMES, _MODS))
#: the kernels a decode step of each layer must launch on the Triton path (module, entry);
#: a one-row step's DeltaNet fuses the conv into its input projection's GEMV
_DECODE_KERNELS = {
    "linear_attention": [("norm", "fused_add_rms_norm_triton"),
                         ("causal_conv_update", "causal_conv_update_triton"),
                         ("gated_delta_decode", "gated_delta_decode_gates_triton"),
                         ("norm", "gated_rms_norm_triton")],
    "linear_attention_one_row": [("norm", "fused_add_rms_norm_triton"),
                                 ("deltanet_proj", "in_proj_conv_triton"),
                                 ("gated_delta_decode", "gated_delta_decode_gates_triton"),
                                 ("norm", "gated_rms_norm_triton")],
    "full_attention": [("norm", "fused_add_rms_norm_triton"),
                       ("rope_decode", "rope_paged_decode_triton")],
}
#: what a one-row decode step must not launch (fused away)
_FUSED_AWAY = {"linear_attention_one_row": [("causal_conv_update", "causal_conv_update_triton")]}


def _spy(monkeypatch, layer_type) -> dict:
    """Count the calls of the layer type's decode kernels (and of those it fuses away)."""
    calls: dict = {}
    for mod, name in _DECODE_KERNELS[layer_type] + _FUSED_AWAY.get(layer_type, []):
        fn = getattr(_MOD[mod], name)

        def spy(*a, _fn=fn, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **kw)

        monkeypatch.setattr(_MOD[mod], name, spy)
    return calls


def _run_layer(layer_type, interpreted, monkeypatch, prompt_lens=(7, 5)):
    """The layer's outputs over the steps and its cache afterwards, on one path."""
    kernels = layer_type + ("_one_row" if len(prompt_lens) == 1
                            and layer_type == "linear_attention" else "")
    if interpreted:
        use_interpreted(monkeypatch, _NAMES, _MODS)
        calls = _spy(monkeypatch, kernels)
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = _cfg(layer_type)
    torch.manual_seed(0)
    mixer = GatedDeltaNet(cfg) if layer_type == "linear_attention" else GatedAttention(cfg)
    norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    _init(mixer, 1)
    _init(norm, 2)
    if layer_type == "linear_attention":
        with torch.no_grad():
            mixer.A_log.copy_(torch.linspace(-1, 1, cfg.linear_num_value_heads))
        spec = mixer.cache_spec()
        gen = torch.Generator().manual_seed(3)
        cache = (torch.randn(4, *spec.conv_shape, generator=gen),
                 torch.randn(4, *spec.recurrent_shape, generator=gen))
    else:
        gen = torch.Generator().manual_seed(3)
        cache = tuple(torch.randn(12, BS, cfg.num_kv_heads, cfg.head_dim, generator=gen)
                      for _ in range(2))
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta)
    tables = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)[:len(prompt_lens)]
    slots = torch.tensor([2, 1])[:len(prompt_lens)]
    gen = torch.Generator().manual_seed(4)
    outs = []
    for n, qsl, seq_lens, decode in _steps(list(prompt_lens), 3):
        x, res = (torch.randn(n, cfg.hidden_size, generator=gen) for _ in range(2))
        meta, positions = _meta(qsl, seq_lens, decode, tables, slots)
        with torch.no_grad():
            h, res = norm(x, res)
            outs.append(mixer(positions, h, cache, meta, rope))
        if interpreted and not decode:  # count the decode steps' launches only
            calls.clear()
    if interpreted:  # every decode step (3) ran each of them, and none what it fuses away
        assert all(calls.get(name, 0) >= 3 for _, name in _DECODE_KERNELS[kernels]), calls
        assert not any(calls.get(name) for _, name in _FUSED_AWAY.get(kernels, [])), calls
    return outs, cache


@pytest.mark.parametrize("prompt_lens", [(7, 5), (7,)], ids=["two_seqs", "one_seq"])
@pytest.mark.parametrize("layer_type", ["linear_attention", "full_attention"])
def test_layer_on_the_kernels_follows_the_reference(layer_type, prompt_lens, monkeypatch):
    want, want_cache = _run_layer(layer_type, False, monkeypatch, prompt_lens)
    got, got_cache = _run_layer(layer_type, True, monkeypatch, prompt_lens)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **TOL, msg=f"step {i}")
    for g, w in zip(got_cache, want_cache, strict=True):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("graph", [False, True], ids=["eager_fold", "graph_fold"])
@pytest.mark.parametrize("interpreted", [True, False], ids=["kernels", "reference"])
def test_held_verify_runs_log_and_fold_to_a_plain_decode(interpreted, graph, monkeypatch):
    """A step of 6 one-token rows (as attention sees them): a plain decode row of sequence 0,
    then verifies of 3 and 2 tokens for sequences 1 and 2, held (``StateRuns``). The held
    states are untouched by the step, every row's projections are logged, and ``fold`` of 2
    and 1 kept tokens leaves each state as a plain decode of its kept tokens, while the plain
    row's state advanced in the step itself. ``graph``: the fold a verify graph of 8 rows
    replays (its logged rows padded, every row outside a kept prefix a run of its own, the
    grid padded to 16 runs on the spare slot 0, which stays untouched)."""
    if interpreted:
        use_interpreted(monkeypatch, _NAMES, _MODS)
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = _cfg("linear_attention")
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg)
    _init(layer, 1)
    spec = layer.cache_spec()
    gen = torch.Generator().manual_seed(3)
    cache = (torch.randn(5, *spec.conv_shape, generator=gen),
             torch.randn(5, *spec.recurrent_shape, generator=gen))
    plain = tuple(c.clone() for c in cache)
    tables = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0]], dtype=torch.int32)
    slots, lens = [4, 2, 1], [5, 9, 6]  # each sequence's state slot and KV length before
    x = torch.randn(6, cfg.hidden_size, generator=gen)
    rows = [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]  # (sequence, position offset)
    meta, pos = _meta(tuple(range(7)), tuple(lens[s] + i + 1 for s, i in rows), False,
                      tables[[s for s, _ in rows]], torch.tensor([slots[s] for s, _ in rows]),
                      state_runs=StateRuns((0, 1, 4, 6), slots, [False] * 3, (1, 2)))
    with torch.no_grad():
        layer(pos, x, cache, meta)
    (mixed, a, b), = meta.state_runs.log  # every row: conv inputs, the projections a and b
    assert mixed.shape[0] == a.shape[0] == b.shape[0] == 6
    for s in (2, 1):  # the held states are as they were
        assert torch.equal(cache[1][s], plain[1][s]) and torch.equal(cache[0][s], plain[0][s])
    logged = (mixed, a, b)
    if graph:
        runs, first = fold_runs(meta.state_runs, [2, 1], singles=True)
        assert first == 0 and runs.cu == (0, 1, 3, 4, 5, 6) and runs.hold == (0, 2, 4)
        runs = runs.padded(8, 16, 0)
        logged = tuple(torch.cat([t, torch.randn(2, t.shape[1])]) for t in logged)
    else:
        runs, first = fold_runs(meta.state_runs, [2, 1])
        assert first == 1 and runs.cu == (0, 2, 3, 4, 5) and runs.hold == (1, 3)
    with torch.no_grad():
        layer.fold(logged, cache, runs, first)
        for s, r in ((0, 0), (1, 1), (1, 2), (2, 4)):  # plain decodes of the kept tokens
            m, p = _meta((0, 1), (lens[s] + 1,), True,  # (its KV length: unread here)
                         tables[s:s + 1], torch.tensor([slots[s]]))
            layer(p, x[r:r + 1], plain, m)
    for s in slots:
        torch.testing.assert_close(cache[1][s], plain[1][s], **TOL)
        torch.testing.assert_close(cache[0][s], plain[0][s], **TOL)
    assert torch.equal(cache[1][0], plain[1][0]) and torch.equal(cache[0][0], plain[0][0])


@pytest.mark.parametrize("runs", range(1, 10))
def test_state_runs_reach_the_device_as_given(runs):
    """``StateRuns.tensors`` (one packed copy) gives back the host's slots, offsets, fresh and
    hold flags, whatever the number of runs (its sections must not overlap)."""
    gen = torch.Generator().manual_seed(runs)
    lens = torch.randint(0, 5, (runs,), generator=gen).tolist()
    cu = tuple(int(x) for x in torch.tensor([0] + lens).cumsum(0))
    slots = torch.randperm(20, generator=gen)[:runs].tolist()
    fresh = (torch.rand(runs, generator=gen) < 0.5).tolist()
    hold = tuple(i for i in range(runs) if i % 2)
    got = StateRuns(cu, slots, fresh, hold).tensors(torch.device("cpu"))
    assert [t.tolist() for t in got] == [slots, list(cu), fresh,
                                         [i in hold for i in range(runs)]]
    assert [t.dtype for t in got] == [torch.int64, torch.int32, torch.bool, torch.bool]


def test_a_steps_layers_share_one_fresh_mask():
    """A pure decode step's DeltaNet layers compute ``seq_lens_t == 1`` once (one launch a step):
    the same metadata gives the same mask, a new one or lengths written in place a new mask;
    inference tensors (no version counter) work too. (A CUDA graph capture never reuses an
    eager mask: tests/gpu/test_hybrid_decode_gpu.py.)"""
    from epserve.models.gated_deltanet import fresh_sequences

    def meta(lens):
        return AttentionMetadata(slot_mapping=torch.tensor([0, 1]), query_start_loc=(0, 1, 2),
                                 seq_lens=(1, 1), block_tables=torch.zeros(2, 1, dtype=torch.int32),
                                 block_size=BS, seq_lens_t=lens, state_slots=torch.tensor([1, 2]))

    lens = torch.tensor([1, 5], dtype=torch.int32)
    m = meta(lens)
    first = fresh_sequences(m, lens.device)
    assert fresh_sequences(m, lens.device) is first and first.tolist() == [True, False]
    lens.copy_(torch.tensor([3, 1]))
    again = fresh_sequences(m, lens.device)
    assert again is not first and again.tolist() == [False, True]
    assert fresh_sequences(meta(lens), lens.device) is not again
    with torch.inference_mode():
        li = torch.tensor([2, 1], dtype=torch.int32)
        mi = meta(li)
        assert fresh_sequences(mi, li.device) is fresh_sequences(mi, li.device)
        assert fresh_sequences(mi, li.device).tolist() == [False, True]
