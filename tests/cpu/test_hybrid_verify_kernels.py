"""A speculative verify on a hybrid as CUDA runs it (every Triton kernel in the interpreter, on
CPU): each DeltaNet layer's verify of k + 1 tokens a sequence and the fold of the accepted
prefix take the varlen kernels (one launch a layer each for the conv and the rule, g and beta
computed in the rule's, the verify's sequences held), not the chunked prefill path; the greedy output and logprobs are
the output without speculation on the same kernels. (On an H200 the chunked path made a verify
step ~150 ms against a 2.9 ms decode step: bench/RESULTS.md, session 16.)"""

from __future__ import annotations

import pytest
from kernel_interp import HAS_TRITON, interpreted_modules, use_interpreted

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import epserve.kernels.causal_conv as conv_op  # noqa: E402
import epserve.kernels.gated_delta as delta_op  # noqa: E402
from epserve import LLM, SamplingParams  # noqa: E402
from spec_ckpt import counting_prompts, make_successor_checkpoint  # noqa: E402

_NAMES = ("norm", "linear", "causal_conv_update", "gated_delta_decode", "rope", "rope_decode",
          "paged_attention", "paged_prefill", "kv_write", "deltanet_proj", "shared_expert",
          "norm_router", "router", "fused_moe", "moe_align", "sampling_noise")
_MODS = interpreted_modules(*_NAMES)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def test_verify_and_fold_take_the_varlen_kernels_and_change_nothing(tmp_path, monkeypatch):
    ckpt = make_successor_checkpoint("qwen3_next", tmp_path / "m")
    reqs = [{"prompt_token_ids": counting_prompts()[0]}]  # 21 tokens, its start recurring
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    want = LLM(model=str(ckpt), dtype="float32", seed=0, max_model_len=64).generate(reqs, sp)
    use_interpreted(monkeypatch, _NAMES, _MODS)  # the reference above, the kernels below
    calls = {"rule": 0, "conv": 0, "held": 0, "chunked": 0, "gates": 0}

    def spy(mod, name, key):
        real = getattr(mod, name)

        def counted(*args, **kw):
            calls[key] += 1
            calls["held"] += int(args[-1].sum()) if key == "rule" else 0
            return real(*args, **kw)
        monkeypatch.setattr(mod, name, counted)

    spy(_MODS[_NAMES.index("gated_delta_decode")], "gated_delta_varlen_triton", "rule")
    spy(_MODS[_NAMES.index("causal_conv_update")], "causal_conv_varlen_triton", "conv")
    spy(delta_op, "chunked_ref", "chunked")  # the prompt's prefill (21 tokens: not short)
    spy(conv_op, "causal_conv1d_ref", "chunked")
    spy(delta_op, "delta_gates_ref", "gates")  # g and beta as torch ops: the prefill's only
    spec = LLM(model=str(ckpt), dtype="float32", seed=0, max_model_len=64,
               speculative_config=NGRAM)
    got = spec.generate(reqs, sp)
    for w, g in zip(want, got, strict=True):
        assert w.outputs[0].token_ids == g.outputs[0].token_ids
        for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    st = spec.engine.stats.spec
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    layers = sum(1 for m in spec.model.runner.model.modules()
                 if type(m).__name__ == "GatedDeltaNet")
    assert calls["held"] == st.num_drafts * layers  # each verify: every layer, held
    assert calls["conv"] == calls["rule"] == 2 * calls["held"]  # a verify and its fold
    assert calls["chunked"] == 2 * layers  # the prompt's prefill, nothing more
    assert calls["gates"] == layers  # verify and fold compute g and beta in their kernel


def test_the_graphs_of_a_speculative_step_change_nothing(trained_mtp_ckpt, monkeypatch):
    """What the verify graphs and the MTP head's pass graphs replay, on CPU: each step's inputs
    copied into a rung's static buffers (rows padded to the rung, the recurrent runs padded as
    ``StateRuns.padded`` lays them out with only placeholders on the host, the head's input
    hidden states copied into its own buffer) and the captured forward, fold and head pass
    called over them (``capture(eager_twins=True)``: the graphs' own inputs, no CUDA; the
    kernels interpreted, as the device tensors are their truth). Two sequences verify 2
    drafts each (6 rows: rung 8, padded); the output is the output without speculation, and
    drafts are accepted."""
    from epserve.worker.cuda_graphs import DecodeGraphs, graph_batch

    reqs = [{"prompt_token_ids": list(range(a, a + 5))} for a in (20, 150)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    want = LLM(model=str(trained_mtp_ckpt), dtype="float32", seed=0,
               max_model_len=64).generate(reqs, sp)
    use_interpreted(monkeypatch, _NAMES, _MODS)
    spec = LLM(model=str(trained_mtp_ckpt), dtype="float32", seed=0, max_model_len=64,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    runner = spec.model.runner
    runner.verify_graphs = DecodeGraphs(
        runner._forward, runner.device, runner.block_size, 8, runner.tables.max_blocks_per_seq,
        runner.spare_state_slot, runs=True,
        fold=lambda logged, runs: runner.model.fold_logged(runner.kv_caches, logged, runs, 0))
    runner.verify_graphs.capture(eager_twins=True)
    runner.mtp.capture_graphs(8, eager_twins=True)
    folds, rows = [], []
    real, run = runner.verify_graphs.replay_fold, runner.verify_graphs.run
    monkeypatch.setattr(runner.verify_graphs, "replay_fold",
                        lambda f: folds.append(f) or real(f))
    monkeypatch.setattr(runner.verify_graphs, "run",
                        lambda inp, *a: rows.append(inp.rows.num_decode) or run(inp, *a))
    got = spec.generate(reqs, sp)
    for w, g in zip(want, got, strict=True):
        assert w.outputs[0].token_ids == g.outputs[0].token_ids
        for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in a)
    st = spec.engine.stats.spec
    assert st.num_accepted_tokens > 0
    assert runner.verify_graphs.replays > 0 and runner.mtp.graphs[0].replays > 0
    assert len(folds) == runner.verify_graphs.replays == runner.verify_graphs.fold_replays
    assert any(graph_batch(n) > n for n in rows)  # a rung with padding rows and runs
