"""``logit_bias`` below the HTTP edge: ``SamplingParams(logit_bias=...)`` on the offline ``LLM``
steers greedy and sampled rows, its logprobs stay those of the raw logits (vLLM's default), an
id outside the vocabulary is refused naming it; the sampler adds the biases only to the rows
that have them; the pairs travel in the step command exactly (float64) and every rank's
validator judges them by the rule the edge applies; an engine whose commands and results go
through frames, as every expert-parallel rank's do, gives the in-process engine's outputs."""

from __future__ import annotations

import math

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.head.limits import RequestLimits
from epserve.models.traits import EpCommandFailed, RowSampling
from epserve.worker import step_command as P
from epserve.worker.ep_mirror import EpMirror, _Failer
from epserve.worker.sampler import sample_rows
from epserve.worker.step_command import NewSeq, ProtocolError, SamplingUpdate, StepCommand
from fake_ep import Framed

PROMPT = {"prompt_token_ids": [5, 17, 42, 8]}


def _tokens(llm, **kw) -> list[list[int]]:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, **kw))
    return [c.token_ids for c in out[0].outputs]


# --------------------------------------------------------------------------- offline LLM

def test_a_bias_steers_greedy_and_sampled_rows(llm):
    (plain,) = _tokens(llm, temperature=0.0)
    target = next(t for t in range(100, 120) if t not in plain)
    assert _tokens(llm, temperature=0.0, logit_bias={target: 100}) == [[target] * 4]
    sampled = _tokens(llm, temperature=1.0, n=3, seed=1, logit_bias={target: 100.0})
    assert sampled == [[target] * 4] * 3
    # -100 on the greedy choice of each step: never picked
    avoid = {t: -100.0 for t in plain}
    assert not set(_tokens(llm, temperature=0.0, logit_bias=avoid)[0]) & set(plain)


def test_logprobs_stay_those_of_the_raw_logits(llm):
    (plain,) = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0,
                                                   logprobs=5))[0].outputs
    raw = plain.logprobs[0]
    low = min(raw, key=lambda t: raw[t].logprob)  # a listed token the model ranks last
    (biased,) = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5,
                                                    logit_bias={low: 100}))[0].outputs
    got = biased.logprobs[0]
    assert biased.token_ids == [low]
    assert {t: e.logprob for t, e in got.items()} == {t: e.logprob for t, e in raw.items()}


def test_an_id_outside_the_vocabulary_is_refused_naming_it(llm):
    vocab = llm.model.vocab_size()
    with pytest.raises(ValueError, match=rf"SamplingParams\.logit_bias: {vocab + 3} is not a "
                                         rf"token id"):
        llm.generate(PROMPT, SamplingParams(logit_bias={1: 1.0, vocab + 3: 1.0}))
    assert not llm.engine.requests


def test_values_are_clamped_and_the_entries_bounded():
    p = SamplingParams(logit_bias={9: 1e9, 3: -250, 4: 0.5})
    assert p.logit_bias == {3: -100.0, 4: 0.5, 9: 100.0}
    assert p.to_row_sampling(0, ()).logit_bias == ((3, -100.0), (4, 0.5), (9, 100.0))
    assert SamplingParams(logit_bias={}).to_row_sampling(0, ()).logit_bias == ()
    with pytest.raises(ValueError, match=r"^SamplingParams\.logit_bias holds 3 entries; at "
                                         r"most 2 .*\(max_logit_bias\)"):
        RequestLimits(max_logit_bias=2).check(p)


# --------------------------------------------------------------------------- the sampler

def _logits(rows: int = 4, vocab: int = 64) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 3


def test_the_sampler_biases_only_the_rows_that_have_one():
    x = _logits()
    plain = [RowSampling(temperature=0.0, logprobs=2), RowSampling(temperature=1.0, seed=4),
             RowSampling(temperature=0.8, seed=5, top_k=3), RowSampling(temperature=0.0)]
    second = int(x[2].argsort(descending=True)[1])
    biased = list(plain)
    biased[0] = RowSampling(temperature=0.0, logprobs=2, logit_bias=((7, 100.0),))
    biased[2] = RowSampling(temperature=0.8, seed=5, top_k=1, logit_bias=((second, 50.0),))
    before = x.clone()
    alone, mixed = sample_rows(x, plain, [0, 1, 2, 3]), sample_rows(x, biased, [0, 1, 2, 3])
    assert torch.equal(x, before)  # the caller's logits are not written
    assert mixed[0].token_id == 7 and mixed[2].token_id == second  # top_k=1 of the biased
    assert mixed[1] == alone[1] and mixed[3] == alone[3]
    lp = torch.log_softmax(x[0], -1)
    assert mixed[0].logprob == pytest.approx(float(lp[7]))  # raw, not biased
    assert mixed[0].top == alone[0].top


# --------------------------------------------------------------------------- wire and ranks

def _mirror() -> EpMirror:
    return EpMirror(world_size=2, num_blocks=8, block_size=4, max_slots=4,
                    max_blocks_per_seq=4, vocab_size=100)


def test_pairs_travel_exactly_and_ranks_accept_what_the_edge_does():
    s = SamplingParams(logit_bias={2: 0.1, 99: -100, 50: 1 / 3}).to_row_sampling(5, (4,))
    cmd = StepCommand(step_id=0, new_seqs=(NewSeq(1, 2, 0, 3, -1, s),),
                      sampling_updates=())
    out = P.decode(P.encode(cmd))
    assert out == cmd and out.new_seqs[0].sampling.logit_bias == s.logit_bias
    assert list(out.new_seqs[0].sampling.banned_token_ids) == [4]
    _mirror().validate(out)


@pytest.mark.parametrize("pairs, says", [
    (((100, 1.0),), "100 is not a token id in [0, 100)"),
    (((5, 1.0), (3, 1.0)), "token id 3 is not above"),
    (((5, 1.0), (5, 2.0)), "token id 5 is not above"),
    (((5, 100.5),), "the bias of token 5"),
    (((5, math.nan),), "the bias of token 5"),
])
def test_ranks_refuse_bad_pairs_naming_the_sequence(pairs, says):
    cmd = StepCommand(step_id=0, new_seqs=(NewSeq(1, 2, 0, 3, -1, RowSampling(
        logit_bias=pairs)),))
    with pytest.raises(EpCommandFailed) as e:
        _mirror().validate(P.decode(P.encode(cmd)))
    assert "logit_bias" in e.value.reason and says in e.value.reason
    assert e.value.bad_rows == ((1, 2),)


def test_a_count_the_words_cannot_hold_is_a_protocol_error():
    s = RowSampling(banned_token_ids=(1, 2), logit_bias=((3, 1.0),))
    frame = P.encode(StepCommand(step_id=0, sampling_updates=(SamplingUpdate(0, 1, s),)))
    one = (1).to_bytes(8, "little")
    # the record's n_bias (1) sits right before its word count (5): claim 2 pairs in 5 words
    assert frame.count(one + (5).to_bytes(8, "little")) == 1
    bad = frame.replace(one + (5).to_bytes(8, "little"), (2).to_bytes(8, "little")
                        + (5).to_bytes(8, "little"))
    with pytest.raises(ProtocolError, match="logit_bias count"):
        P.decode(bad)


def test_through_frames_as_every_ep_rank_runs_it(qwen3_ckpt):
    kw = dict(model=str(qwen3_ckpt), dtype="float32", max_model_len=32, max_logprobs=-1)
    framed, local = LLM(**kw), LLM(**kw)
    framed.model.channel = Framed(framed.model.rank0)
    vocab = local.model.vocab_size()
    params = [SamplingParams(max_tokens=3, temperature=0.0, logit_bias={17: 100.0},
                             logprobs=vocab, prompt_logprobs=25),
              SamplingParams(max_tokens=3, temperature=1.0, seed=2, n=2,
                             logit_bias={5: 100.0, 6: 100.0}),
              SamplingParams(max_tokens=3, temperature=0.0)]
    prompts = [{"prompt_token_ids": [3 + i, 40 + 7 * i, 11, 90 - i]} for i in range(3)]
    got, want = framed.generate(prompts, params), local.generate(prompts, params)
    assert got[0].outputs[0].token_ids == [17] * 3
    assert [len(d) for d in got[0].outputs[0].logprobs] == [vocab] * 3  # > 20 on the wire
    assert all(set(c.token_ids) <= {5, 6} for c in got[1].outputs)
    for g, w in zip(got, want):
        assert [(c.token_ids, c.logprobs) for c in g.outputs] == \
            [(c.token_ids, c.logprobs) for c in w.outputs]
        assert g.prompt_logprobs == w.prompt_logprobs
