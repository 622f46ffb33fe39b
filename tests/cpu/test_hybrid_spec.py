"""Speculative decoding on gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE), as a user sees it:
the output with an n-gram proposer is the output without speculation (greedy tokens, logprobs,
seeded draws), through chunked prefill and preemption; and, compared directly, after a verify
that accepts only part of its drafts every DeltaNet layer's conv and recurrent state of the
sequence equals the state of a plain decode of the accepted tokens (a rejected draft never
touches a state). Every rank refuses a rewind its recurrent state cannot follow."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.models.traits import EpCommandFailed, RowSampling
from epserve.worker.ep_mirror import EpMirror
from epserve.worker.step_command import (BlockUpdate, NewSeq, PrefillRow, Rewind, StepCommand,
                                         VerifyRow)
from rewind_faults import drive, rewinding_to
from spec_ckpt import counting_prompts, make_successor_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def hybrid_ckpt(request, tmp_path_factory):
    return make_successor_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", seed=0, max_model_len=128, **kw)


def _same(want, got, atol: float = 1e-4) -> None:
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w.outputs, g.outputs, strict=True):
            assert a.token_ids == b.token_ids
            for la, lb in zip(a.logprobs or (), b.logprobs or (), strict=True):
                assert la.keys() == lb.keys()
                for t in la:
                    assert la[t].logprob == pytest.approx(lb[t].logprob, abs=atol)


@pytest.mark.parametrize("case", [{}, {"max_num_batched_tokens": 16, "block_size": 4,
                                       "num_kv_blocks": 24}])
def test_output_is_unchanged_by_ngram_speculation(hybrid_ckpt, case):
    reqs = [{"prompt_token_ids": p} for p in counting_prompts()]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    base, spec = _llm(hybrid_ckpt, **case), _llm(hybrid_ckpt, speculative_config=NGRAM, **case)
    for sp in (greedy, seeded):
        _same(base.generate(reqs, sp), spec.generate(reqs, sp))
    st = spec.engine.stats.spec
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    if case:
        assert spec.engine.scheduler.num_preemptions > 0


def test_a_plain_draft_model_for_a_hybrid_target_changes_nothing(hybrid_ckpt, qwen3_ckpt):
    """A Qwen3-MoE draft model (no recurrent state: its rejected drafts are rewound) for a
    hybrid target: the target's output, token for token."""
    reqs = [{"prompt_token_ids": p} for p in counting_prompts()]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    spec = _llm(hybrid_ckpt, speculative_config={"method": "draft_model", "model":
                                                 str(qwen3_ckpt), "num_speculative_tokens": 2})
    _same(_llm(hybrid_ckpt).generate(reqs, sp), spec.generate(reqs, sp))
    assert spec.engine.stats.spec.num_drafts > 0


def _states(llm: LLM, slot: int) -> list[torch.Tensor]:
    runner = llm.model.runner
    spare = runner.spare_state_slot
    return [t[slot].clone() for cache in runner.kv_caches
            if cache[0].shape[0] == spare + 1 for t in cache]


def _started(llm: LLM, prompt: list[int]):
    m = llm.model
    seq = m.alloc_sequence_for(64, prompt)
    seq.sampling, seq.prompt_len = RowSampling(temperature=0.0), len(prompt)
    assert m.reserve_blocks(seq, len(prompt))
    return seq, m.prefill(prompt, seq).token_id


def test_a_partial_acceptance_leaves_the_state_of_a_plain_decode(hybrid_ckpt):
    prompt = [5, 9, 33, 41, 7, 12, 80, 3]
    plain, spec = _llm(hybrid_ckpt), _llm(hybrid_ckpt)
    want = plain.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    # plain: decode the first three tokens one by one
    seq, first = _started(plain, prompt)
    assert first == want[0]
    for i in (1, 2):
        seq.output_index = i
        assert plain.model.reserve_blocks(seq, seq.seq_len + 1)
        assert plain.model.decode(want[i - 1], seq).token_id == want[i]
    # spec: one verify of [want0, want1, wrong, want3]: the first draft is accepted, the
    # second rejected, so the state takes want0 and want1 only (as the plain decode did)
    sseq, sfirst = _started(spec, prompt)
    wrong = (want[2] + 1) % 300
    sseq.output_index = 1
    assert spec.model.reserve_blocks(sseq, sseq.seq_len + 4)
    run = spec.model.decode_verify_batched([sfirst, want[1], wrong, want[3]], [3], [sseq])[0]
    assert [t.token_id for t in run[:2]] == want[1:3]  # want1 accepted, then the target's
    assert wrong != want[2]  # want2 where the draft said otherwise
    assert sseq.seq_len == seq.seq_len == len(prompt) + 2
    got, exp = _states(spec, sseq.slot_idx), _states(plain, seq.slot_idx)
    assert len(got) == 2 * 3  # conv and recurrent state of each of the 3 DeltaNet layers
    for g, e in zip(got, exp):
        assert torch.allclose(g, e, atol=1e-5, rtol=1e-5)
    # and both go on alike: the next decode and a verify that accepts every draft
    sseq.output_index = seq.output_index = 3
    for m, s in ((plain.model, seq), (spec.model, sseq)):
        assert m.reserve_blocks(s, s.seq_len + 3)
    assert plain.model.decode(want[2], seq).token_id == want[3]
    run = spec.model.decode_verify_batched([want[2], want[3], want[4]], [2], [sseq])[0]
    assert [t.token_id for t in run] == want[3:6]
    for i in (4, 5):
        seq.output_index = i
        assert plain.model.reserve_blocks(seq, seq.seq_len + 1)
        assert plain.model.decode(want[i - 1], seq).token_id == want[i]
    for g, e in zip(_states(spec, sseq.slot_idx), _states(plain, seq.slot_idx)):
        assert torch.allclose(g, e, atol=1e-5, rtol=1e-5)


def _verified_mirror() -> EpMirror:
    """Two ranks of a recurrent model; (1, 2) prefilled 5 tokens, then verified 2 drafts
    (positions 5..7 written)."""
    m = EpMirror(world_size=2, num_blocks=8, block_size=4, max_slots=4, max_blocks_per_seq=4,
                 vocab_size=70, recurrent=True)
    for cmd in (StepCommand(step_id=0, new_seqs=(NewSeq(1, 2, 0, 5, -1, RowSampling()),),
                            block_updates=(BlockUpdate(1, 2, 0, (1, 2)),),
                            prefill=(PrefillRow(1, 2, 0, (3, 4, 5, 6, 7), True, 0, -1),)),
                StepCommand(step_id=1, verify=(VerifyRow(1, 2, 9, 1, (7, 8)),))):
        m.validate(cmd)
        m.apply(cmd)
    return m


@pytest.mark.parametrize("rewind, ok", [(6, True), (7, True), (8, True), (5, False),
                                        (4, False)])
def test_a_rewind_must_stay_inside_the_verify_just_run(rewind, ok):
    m = _verified_mirror()
    cmd = StepCommand(step_id=2, rewinds=(Rewind(1, 2, rewind, 2),))
    if ok:
        m.validate(cmd)
        return
    with pytest.raises(EpCommandFailed, match="recurrent state can only go back") as exc:
        m.validate(cmd)
    assert exc.value.bad_rows == ((1, 2),)


def test_a_rewind_later_than_the_next_command_is_refused():
    m = _verified_mirror()
    later = StepCommand(step_id=2)  # a command in between: the verify is no longer the last
    m.validate(later)
    m.apply(later)
    with pytest.raises(EpCommandFailed, match=r"inside the verify just run \(none\)"):
        m.validate(StepCommand(step_id=3, rewinds=(Rewind(1, 2, 6, 2),)))


def test_a_rewind_outside_the_verify_fails_only_its_request(hybrid_ckpt):
    """A command whose rewind would take a sequence's KV somewhere its states are not (here:
    back past the verify) is refused; only that request fails, with the refusal as its
    error, and the others come out as without speculation."""
    reqs = counting_prompts()
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = _llm(hybrid_ckpt).generate([{"prompt_token_ids": p} for p in reqs], sp)
    llm, fired = _llm(hybrid_ckpt, speculative_config=NGRAM), {}
    ids, owners, final = drive(llm.engine, llm.model, reqs, sp,
                               rewinding_to(lambda n, a, b: a, fired), fired)
    bad = owners[fired["key"]]
    for rid, w in zip(ids, want):
        out = final[rid]
        if rid == bad:
            assert out.outputs[0].finish_reason == "error"
            assert "its recurrent state can only go back inside the verify" in out.error
        else:
            assert out.error is None and out.outputs[0].token_ids == w.outputs[0].token_ids


def test_a_rewind_the_ranks_state_disagrees_with_fails_the_step_not_the_engine(hybrid_ckpt):
    """A rewind inside the verified window but not where the rank folded the states (a leader
    bug) would leave KV and states covering different tokens: the rank refuses the step in its
    agreed preparation, that step's requests fail with the reason, and the engine goes on."""
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = counting_prompts()[0]
    want = _llm(hybrid_ckpt).generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0]
    llm, fired = _llm(hybrid_ckpt, speculative_config=NGRAM), {}

    def elsewhere(n: int, start: int, end: int) -> int | None:
        other = n - 1 if n - 1 > start else n + 1
        return other if other <= end else None

    (rid,), _, final = drive(llm.engine, llm.model, [prompt], sp,
                              rewinding_to(elsewhere, fired), fired)
    assert final[rid].outputs[0].finish_reason == "error"
    assert "preparation failed on rank 0" in final[rid].error
    again = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0]
    assert again.token_ids == want.token_ids
