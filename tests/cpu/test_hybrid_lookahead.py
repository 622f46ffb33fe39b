"""Decode lookahead on a gated-DeltaNet hybrid (``decode_lookahead=True``; on by default
wherever decode graphs are, as for every model): the queued forward advances each row's
recurrent state in place, so the rows' states are copied aside first and copied back when
the forward is dropped. Every test generates the same requests with the lookahead off and on:
token for token the same, with forwards taken (hits) and dropped (rows that stopped early, requests that arrived
mid-decode: the states went back), and none queued for steps of more rows than it copies."""

from __future__ import annotations

import pytest
from lookahead_case import fed_another_token, off_and_on, random_prompts
from tiny_ckpt import make_tiny_checkpoint

from epserve import LLM, SamplingParams


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def hybrid_ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_stopped_rows_drop_the_forward_and_its_state(hybrid_ckpt):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, logprobs=1,
                            stop_token_ids=list(range(3, 20)))
    off, on, llm = off_and_on(hybrid_ckpt, random_prompts(4, seed=11), params, block_size=4)
    assert on == off
    assert "stop" in {r for _, r, _ in on}  # rows did stop early, behind a queued forward
    assert llm.model.lookahead.hits > 10


def test_a_step_fed_another_token_restores_the_state_first(hybrid_ckpt):
    """The trait caller feeds a token other than the one sampled: the queued forward advanced
    the state with the sampled one; it goes back before the step runs the fed token."""
    got = []
    for lookahead in (False, True):
        r = LLM(model=str(hybrid_ckpt), dtype="float32", device="cpu",
                decode_lookahead=lookahead).model
        got.append(fed_another_token(r))
        if lookahead:
            assert r.lookahead.restored >= 1 and r.lookahead.hits >= 1
    assert got[0] == got[1]


def test_rows_beyond_the_copy_run_without_it(hybrid_ckpt):
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 4 * i, ignore_eos=True)
              for i in range(7)]
    off, on, llm = off_and_on(hybrid_ckpt, random_prompts(7, seed=4), params, block_size=4)
    assert on == off
    la = llm.model.lookahead
    assert la.max_state_rows == 4 and 0 < la.launched  # only once 4 rows or fewer were left
    assert la.launched < 30 - 6  # 7 rows for the first 6 steps, 6 until step 10, ...


def _staggered(ckpt, lookahead: bool) -> dict[str, list[int]]:
    llm = LLM(model=str(ckpt), dtype="float32", device="cpu", decode_lookahead=lookahead,
              block_size=4)
    prompts, done, step = random_prompts(3, seed=8), {}, 0
    arrivals = {0: 0, 5: 1, 11: 2}  # each new prefill row drops the queued forward
    while len(done) < len(prompts):
        if step in arrivals:
            i = arrivals[step]
            llm.engine.add_request(f"r{i}", prompts[i]["prompt_token_ids"], SamplingParams(
                temperature=0.0, max_tokens=14 + i, ignore_eos=True))
        done.update((o.request_id, list(o.outputs[0].token_ids))
                    for o in llm.engine.step() if o.finished)
        step += 1
    if lookahead:
        assert llm.model.lookahead.restored >= 2 and llm.model.lookahead.hits > 0
    return done


def test_requests_arriving_mid_decode(hybrid_ckpt):
    assert _staggered(hybrid_ckpt, True) == _staggered(hybrid_ckpt, False)


def test_dropped_forward_gives_every_layer_its_states_back(hybrid_ckpt):
    """The copy aside covers every linear-attention layer's conv and recurrent state of the
    queued rows, and only theirs: states written after the copy (as the queued forward does)
    are exactly the copied ones again once the forward is dropped, other slots untouched."""
    import numpy as np
    import torch

    runner = LLM(model=str(hybrid_ckpt), dtype="float32", device="cpu",
                 decode_lookahead=True).model.runner
    la, caches = runner.lookahead, runner.kv_caches
    from epserve.models.layer_cache import StateCacheSpec

    states = [c for c, spec in zip(caches, runner.model.layer_cache_specs())
              if isinstance(spec, StateCacheSpec)]  # (conv, recurrent) per DeltaNet layer
    assert len(states) >= 2 and len(la.state_pools) == 2  # two layers, one tensor per kind
    gen = torch.Generator().manual_seed(0)
    for conv, rec in states:  # every layer's states are views of the shared tensors
        conv.copy_(torch.randn(conv.shape, generator=gen))
        rec.copy_(torch.randn(rec.shape, generator=gen))
    before = [(c.clone(), r.clone()) for c, r in states]
    slots = np.array([3, 1])
    la._save(slots)
    for conv, rec in states:  # the queued forward advances the rows' states in place
        conv[slots] += 1.0
        rec[slots] *= -2.0
    la.discard()
    assert la.restored == 1
    for (conv, rec), (c0, r0) in zip(states, before):
        assert torch.equal(conv, c0) and torch.equal(rec, r0)
