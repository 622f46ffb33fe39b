"""vLLM's rank of a sampled (or prompt) token outside the top k: the count of vocabulary tokens
whose logprob is at least its own (vLLM's ``batched_count_greater_than``: ``x >= value``, so
1 + the strictly more likely ones when nothing ties with it). The sampler computes it on the
device in the same pass and the same read-back as the logprobs; it travels in the rank's
result frame and the head's output records to ``Logprob.rank``. Checked against transformers'
fp32 logits of the same tiny checkpoint: the offline API, through the frames every EP rank
sends, and through the head-to-client records."""

from __future__ import annotations

import asyncio

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.head.async_engine import AsyncEngine, Outbox
from epserve.head.output_stream import OutputAccumulator, decode_records, encode_records
from epserve.models.traits import PromptTokenLogprob, RowSampling, SampledToken
from epserve.worker import ep_results as R
from epserve.worker.sampler import prompt_logprobs_rows, sample_rows
from epserve.worker.step_command import ProtocolError
from fake_ep import Framed
from oracle import hf_model

PROMPT = [5, 17, 42, 8, 99, 3, 250, 61]
SAMPLED = dict(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)


def _rank(row: torch.Tensor, token: int) -> int:
    """vLLM's rule on one row of logprobs."""
    return int((row >= row[token]).sum())


@torch.inference_mode()
def _hf_logprobs(ckpt, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is transformers' fp32 log-softmax after ids[..=i]."""
    return torch.log_softmax(hf_model(str(ckpt))(torch.tensor([ids])).logits[0].float(), -1)


@pytest.fixture(scope="module")
def llm(qwen3_ckpt) -> LLM:
    return LLM(model=str(qwen3_ckpt), dtype="float32", seed=0, max_model_len=64)


# --------------------------------------------------------------------------- the sampler

def test_the_sampler_ranks_by_vllms_rule():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)) * 3
    x[3, 10] = x[3, 20] = 50.0  # a tie at the top: greedy takes 10, both count for its rank
    rows = [RowSampling(temperature=1.0, seed=1, logprobs=1),
            RowSampling(temperature=1.5, seed=2, logprobs=0, top_k=9),
            RowSampling(temperature=1.0, seed=3),  # no logprobs: no rank
            RowSampling(temperature=0.0, logprobs=0),
            RowSampling(temperature=2.0, seed=4, logprobs=3, banned_token_ids=(0, 1))]
    out = sample_rows(x, rows, [0, 4, 1, 0, 2])
    lsm = torch.log_softmax(x, -1)
    for i in (0, 1, 3, 4):
        assert out[i].rank == _rank(lsm[i], out[i].token_id), i
    assert out[2].rank is None and out[2] == SampledToken(out[2].token_id)
    assert out[3].token_id == 10 and out[3].rank == 2


def test_prompt_logprobs_rows_rank_every_target():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    targets = [3, 0, 63, 64]  # the last is outside the vocabulary: no rank
    got = prompt_logprobs_rows(x, targets, 2)
    lsm = torch.log_softmax(x, -1)
    assert [g.rank for g in got[:3]] == [_rank(lsm[i], t) for i, t in enumerate(targets[:3])]
    assert got[3].rank is None
    no_top = prompt_logprobs_rows(x[:3], targets[:3], 0)
    assert [g.rank for g in no_top] == [g.rank for g in got[:3]]


# --------------------------------------------------------------------------- offline API

def _check_sampled(out, ckpt, k: int) -> int:
    """Every sampled token's ``Logprob.rank``: its top-k position when listed (vLLM's dict),
    else its real rank from transformers' logits; returns how many fell outside the top k."""
    c = out.outputs[0]
    lp = _hf_logprobs(ckpt, out.prompt_token_ids + c.token_ids)
    outside = 0
    for i, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        want = _rank(lp[len(out.prompt_token_ids) - 1 + i], t)
        if want > k:
            outside += 1
            assert len(d) == k + 1 and list(d)[0] == t
            assert d[t].rank == want, (i, t)
        else:
            assert d[t].rank == want  # listed: its place in the top k
    return outside


def test_sampled_tokens_outside_the_top_carry_their_rank(llm, qwen3_ckpt):
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**SAMPLED, logprobs=1))[0]
    assert _check_sampled(out, qwen3_ckpt, 1) >= 6  # temperature 1 on a random model
    zero = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**SAMPLED, logprobs=0))[0]
    assert zero.outputs[0].token_ids == out.outputs[0].token_ids
    assert [d[t].rank for t, d in zip(zero.outputs[0].token_ids, zero.outputs[0].logprobs)] == \
        [d[t].rank for t, d in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**SAMPLED))[0]
    assert plain.outputs[0].logprobs is None


def test_prompt_tokens_outside_the_top_carry_their_rank(llm, qwen3_ckpt):
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
    lp = _hf_logprobs(qwen3_ckpt, PROMPT)
    assert out.prompt_logprobs[0] is None
    ranks = []
    for i in range(1, len(PROMPT)):
        d, t = out.prompt_logprobs[i], PROMPT[i]
        ranks.append(d[t].rank)
        assert d[t].rank == _rank(lp[i - 1], t), i
        assert sorted(e.rank for tid, e in d.items() if tid != t) == ([1] if d[t].rank > 1
                                                                      else [])
    assert sum(r > 1 for r in ranks) >= 4, ranks


# --------------------------------------------------------------------------- the wire

def test_through_frames_as_every_ep_rank_sends_them(qwen3_ckpt, llm):
    framed = LLM(model=str(qwen3_ckpt), dtype="float32", seed=0, max_model_len=64)
    framed.model.channel = Framed(framed.model.rank0)
    params = [SamplingParams(**SAMPLED, logprobs=1, prompt_logprobs=2),
              SamplingParams(**{**SAMPLED, "seed": 8}, n=2, logprobs=0)]
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[::-1]}]
    got, want = framed.generate(prompts, params), llm.generate(prompts, params)
    for g, w in zip(got, want):
        assert [(c.token_ids, c.logprobs) for c in g.outputs] == \
            [(c.token_ids, c.logprobs) for c in w.outputs]
        assert g.prompt_logprobs == w.prompt_logprobs
    assert _check_sampled(got[0], qwen3_ckpt, 1) >= 6
    assert any(d[t].rank > 2 for t, d in zip(PROMPT[1:], got[0].prompt_logprobs[1:]))


def test_result_frames_carry_ranks_and_refuse_a_negative_one():
    res = R.RankResult(1, 0, {2: SampledToken(5, -3.0, ((9, -0.5),), 17), 4: SampledToken(6)},
                       {2: [PromptTokenLogprob(7, -1.0, (), 3), PromptTokenLogprob(8, -2.0)]},
                       {4: [SampledToken(1, -0.1, (), 1), SampledToken(2, -4.0, (), 40)]})
    out = R.decode_result(R.encode_result(res))
    assert out == res and out.sampled[2].rank == 17 and out.sampled[4].rank is None
    assert [e.rank for e in out.prompt_logprobs[2]] == [3, None]
    assert [e.rank for e in out.verified[4]] == [1, 40]
    for table in ("sampled", "prompt_logprobs", "verified"):
        bad = {"sampled": {}, "prompt_logprobs": {}, "verified": {}}
        bad[table] = {2: SampledToken(5, -1.0, (), -3) if table == "sampled" else
                      [PromptTokenLogprob(5, -1.0, (), -3)]}
        with pytest.raises(ProtocolError, match="negative rank"):
            R.decode_result(R.encode_result(R.RankResult(1, 0, bad["sampled"],
                                                         bad["prompt_logprobs"],
                                                         bad["verified"])))


def test_the_head_to_client_records_carry_ranks(qwen3_ckpt):
    own = LLM(model=str(qwen3_ckpt), dtype="float32", seed=0, max_model_len=64)
    params = SamplingParams(**SAMPLED, logprobs=1, prompt_logprobs=1)
    want = own.generate({"prompt_token_ids": PROMPT}, params)[0]
    aengine = AsyncEngine(own.engine)  # from here on only its thread steps the engine

    async def serve():
        outbox = Outbox("client-0")
        acc = OutputAccumulator("r0", None, PROMPT, 1, True)
        aengine.submit(outbox, "r0", PROMPT, params)
        while not acc.output.finished:
            for rec in decode_records(encode_records(await outbox.take(1.0))):
                acc.apply(rec)
        return acc.output

    try:
        got = asyncio.run(serve())
    finally:
        aengine.shutdown()
    strip = [{t: (e.logprob, e.rank) for t, e in d.items()} for d in want.outputs[0].logprobs]
    assert [{t: (e.logprob, e.rank) for t, e in d.items()} for d in got.outputs[0].logprobs] \
        == strip
    assert any(d[t].rank > 1 for t, d in zip(got.outputs[0].token_ids, got.outputs[0].logprobs))
    assert [None if d is None else {t: e.rank for t, e in d.items()}
            for d in got.prompt_logprobs] == \
        [None if d is None else {t: e.rank for t, e in d.items()} for d in want.prompt_logprobs]
