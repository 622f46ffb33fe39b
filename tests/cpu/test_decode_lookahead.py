"""Decode lookahead changes when a forward runs, never what a user gets: every test generates
the same requests with the lookahead on and off and compares the outputs token for token.

On CPU the lookahead forward runs eagerly (``decode_lookahead=True``), which exercises the
same bookkeeping the GPU path uses with graphs: which steps it may run ahead, when the head's
next step matches it, and what happens to the KV it wrote when the step does not.
"""

from __future__ import annotations

import pytest
from lookahead_case import fed_another_token
from lookahead_case import off_and_on as _both
from lookahead_case import random_prompts as _prompts

from epserve import LLM, SamplingParams

EOS = 2


def test_same_outputs_with_lookahead_greedy_and_seeded(tiny_ckpt):
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, top_k=0 if i % 3 else 20,
                             max_tokens=5 + 7 * i, ignore_eos=True, logprobs=2 if i == 3 else None)
              for i in range(6)]
    off, on, llm = _both(tiny_ckpt, prompts, params, block_size=4)
    assert on == off
    la = llm.model.lookahead
    assert la.hits > 20 and la.hits == la.launched  # a length stop is known one step ahead


def test_stop_tokens_and_eos_end_rows_the_lookahead_ran_ahead_of(qwen3_ckpt):
    prompts = _prompts(8, seed=11)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, stop_token_ids=[7, 8, 9])
    off, on, llm = _both(qwen3_ckpt, prompts, params, block_size=4)
    assert on == off
    reasons = {r for _, r, _ in on}
    assert "stop" in reasons  # some rows did stop early, behind a lookahead forward
    la = llm.model.lookahead
    assert 0 < la.hits < la.launched


def test_preemption_under_a_small_kv_pool(qwen3_ckpt):
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    off, on, llm = _both(qwen3_ckpt, prompts, params, block_size=4, num_kv_blocks=24)
    assert on == off
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.model.lookahead.hits > 0


def _staggered(ckpt, lookahead: bool) -> dict[str, list[int]]:
    """Requests arriving while others decode (new prefill rows break the lookahead)."""
    llm = LLM(model=str(ckpt), dtype="float32", device="cpu", decode_lookahead=lookahead,
              block_size=4)
    eng = llm.engine
    prompts = _prompts(5, seed=8)
    done: dict[str, list[int]] = {}
    arrivals = {0: 0, 3: 1, 4: 2, 9: 3, 17: 4}
    step = 0
    while len(done) < len(prompts):
        if step in arrivals:
            i = arrivals[step]
            eng.add_request(f"r{i}", prompts[i]["prompt_token_ids"],
                            SamplingParams(temperature=0.0, max_tokens=12 + i, ignore_eos=True))
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    return done


def test_requests_arriving_mid_decode(qwen3_ckpt):
    assert _staggered(qwen3_ckpt, True) == _staggered(qwen3_ckpt, False)


def test_a_step_fed_another_token_recomputes(qwen3_ckpt):
    """The trait caller feeds a token other than the one sampled: the queued forward (of the
    sampled token) is dropped and the step computes the fed token, as without lookahead."""
    got = []
    for lookahead in (False, True):
        r = LLM(model=str(qwen3_ckpt), dtype="float32", device="cpu",
                decode_lookahead=lookahead).model
        got.append(fed_another_token(r))
        if lookahead:  # the forward of the other token missed, the next one hit
            assert r.lookahead.launched >= 2 and r.lookahead.hits == 1
    assert got[0] == got[1]


def test_lookahead_with_expert_parallelism_is_refused(qwen3_ckpt):
    with pytest.raises(ValueError, match="decode_lookahead=True needs ep_size=1"):
        LLM(model=str(qwen3_ckpt), device="cpu", decode_lookahead=True, ep_size=2)
    with pytest.raises(ValueError, match="decode_lookahead must be"):
        LLM(model=str(qwen3_ckpt), device="cpu", decode_lookahead="yes")


def _two_batches(ckpt, lookahead: bool) -> tuple[list, list[int]]:
    """Two batches one after the other on a pool that the first leaves full of cached
    prefixes; each batch's outputs and lookahead forwards."""
    llm = LLM(model=str(ckpt), dtype="float32", device="cpu", decode_lookahead=lookahead,
              block_size=4, num_kv_blocks=40)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs, launched = [], []
    for seed in (21, 22):
        before = llm.model.lookahead.launched if lookahead else 0
        outs.append([o.outputs[0].token_ids for o in llm.generate(_prompts(4, seed), params)])
        launched.append(llm.model.lookahead.launched - before if lookahead else 0)
    pool = llm.model.book.pools[0]
    assert pool.num_cached_free_blocks() > pool.num_free_blocks()  # the pool a server runs at
    return outs, launched


def test_the_lookahead_runs_on_a_pool_of_cached_prefixes(tiny_ckpt):
    # a server's pool after a while: every free block caches a prefix. The lookahead's next
    # block comes from them (as the scheduler's would), so the second batch is run ahead as
    # often as the first, which found free blocks (it stopped at every block boundary)
    off, _ = _two_batches(tiny_ckpt, False)
    on, launched = _two_batches(tiny_ckpt, True)
    assert on == off
    assert launched[0] >= 15 and launched[1] == launched[0]  # 18 of 20 steps; 9 before
