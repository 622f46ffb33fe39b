"""Gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE) through the offline API, as a user sees
them, against transformers fp32: greedy continuations token-identical and logprobs (and prompt
logprobs) within 1e-4, with the prompts chunked across the linear-attention layers, a KV pool
small enough to preempt (a preempted sequence recomputes its state from zero) and requests
arriving while others run. What hybrids cannot do yet is refused or reported, never ignored:
prefix caching is off (no state snapshots), serving as a draft model is refused, and every
rank refuses a command that would need state it does not have
(speculative decoding on hybrids: tests/cpu/test_hybrid_spec.py)."""

from __future__ import annotations

import random

import pytest

from epserve import LLM, SamplingParams
from epserve.models.traits import EpCommandFailed, RowSampling
from epserve.worker.ep_mirror import EpMirror
from epserve.worker.step_command import NewSeq, Rewind, StepCommand
from oracle import hf_greedy, hf_prompt_logprobs
from tiny_ckpt import make_tiny_checkpoint

NEW = 20
ATOL = 1e-4


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def hybrid_ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0, **kw)


def test_chunked_preempted_and_mid_run_requests_match_transformers(hybrid_ckpt):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 7, 12, 21, 30, 9)]
    # 16-token steps and 8-token chunks split every longer prompt over several steps; 40
    # blocks of 4 cannot hold all six sequences, so some are preempted and recomputed
    llm = LLM(model=str(hybrid_ckpt), dtype="float32", max_num_batched_tokens=16,
              long_prefill_token_threshold=8, block_size=4, num_kv_blocks=40)
    eng, finished, order = llm.engine, {}, []
    for i, p in enumerate(prompts):
        params = _greedy(prompt_logprobs=1) if i == 4 else _greedy()
        order.append(eng.add_request(f"r{i}", p, params).request_id)
        for _ in range(2):  # a few steps between arrivals
            finished.update((o.request_id, o) for o in eng.step() if o.finished)
    while eng.has_unfinished():
        finished.update((o.request_id, o) for o in eng.step() if o.finished)
    assert eng.scheduler.num_preemptions > 0
    for p, rid in zip(prompts, order):
        got = finished[rid].outputs[0]
        want_ids, want_lps = hf_greedy(hybrid_ckpt, p, NEW)
        assert got.token_ids == want_ids, f"prompt of {len(p)} tokens diverged"
        got_lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert got_lps == pytest.approx(want_lps, abs=ATOL)
    plps = finished[order[4]].prompt_logprobs
    for pos, (lp, _) in enumerate(hf_prompt_logprobs(hybrid_ckpt, prompts[4]), start=1):
        assert plps[pos][prompts[4][pos]].logprob == pytest.approx(lp, abs=ATOL)
    # every sequence's KV came back (nothing is kept for a prefix cache)
    assert llm.model.num_free_blocks() == 40


def test_prefix_caching_is_off_and_reported(hybrid_ckpt, caplog):
    caplog.set_level("INFO")
    llm = LLM(model=str(hybrid_ckpt), dtype="float32", block_size=4)
    assert "prefix caching is off" in caplog.text
    assert not llm.engine.scheduler.cfg.enable_prefix_caching  # what /metrics reports too
    prompt = list(range(3, 40))
    first, again = (llm.generate([{"prompt_token_ids": prompt}], _greedy())[0]
                    for _ in range(2))
    assert again.num_cached_tokens == 0  # the same prompt again is computed in full
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_what_hybrids_cannot_do_yet_is_refused(hybrid_ckpt, qwen3_ckpt):
    # a draft model's drafts are rewound anywhere; a recurrent state only inside a verify
    with pytest.raises(ValueError, match="draft model with recurrent state"):
        LLM(model=str(qwen3_ckpt), dtype="float32", speculative_config={
            "method": "draft_model", "model": str(hybrid_ckpt), "num_speculative_tokens": 2})


def test_every_rank_refuses_a_command_needing_state_it_lacks():
    """A recurrent model's state exists only for the tokens the rank ran: a new sequence with
    KV already (a prefix hit), or a rewind with no verify before it, is EpCommandFailed
    naming it."""
    m = EpMirror(world_size=2, num_blocks=8, block_size=4, max_slots=4, max_blocks_per_seq=4,
                 vocab_size=70, recurrent=True)
    bad = [StepCommand(step_id=0, new_seqs=(NewSeq(1, 2, 4, 6, -1, RowSampling()),)),
           StepCommand(step_id=1, new_seqs=(NewSeq(1, 2, 0, 6, -1, RowSampling()),),
                       rewinds=(Rewind(1, 2, 0, 0),))]
    for cmd, why in zip(bad, ("KV for 4 tokens.*recurrent state", "can only go back inside")):
        with pytest.raises(EpCommandFailed, match=why) as exc:
            m.validate(cmd)
        assert exc.value.bad_rows == ((1, 2),)
    ok = StepCommand(step_id=2, new_seqs=(NewSeq(1, 2, 0, 6, -1, RowSampling()),))
    m.validate(ok)  # the same sequence from zero is fine
