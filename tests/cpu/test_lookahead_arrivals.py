"""A request that arrives while a decode step runs makes the next step take new rows, so a
forward queued ahead of it would be dropped (and the next step would wait behind it on the
GPU's stream): the decode lookahead holds back then, and only then. The engine's feeder
(``AsyncEngine``) tells it: a submission or an abort waiting in its inbox.

On CPU the lookahead runs eagerly (``decode_lookahead=True``): the same bookkeeping as the GPU's
graphs. The outputs are the same with and without it either way."""

from __future__ import annotations

from lookahead_case import random_prompts

from epserve import LLM, SamplingParams
from epserve.head.async_engine import AsyncEngine

ARRIVALS = {4: 1, 9: 2, 15: 3}  # step -> the request that arrives before it


def _staggered(ckpt, watch: bool) -> tuple[dict[str, list[int]], object]:
    """Requests arriving while others decode, as over HTTP; with ``watch`` the lookahead
    knows before each arrival (as the AsyncEngine's inbox tells it)."""
    llm = LLM(model=str(ckpt), dtype="float32", device="cpu", decode_lookahead=True)
    la = llm.model.lookahead
    prompts, done, step = random_prompts(4, seed=3), {}, 0
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.engine.add_request("r0", prompts[0]["prompt_token_ids"], params)
    while len(done) < len(prompts):
        if watch:  # this step's lookahead: is a request about to arrive?
            la.arrivals = (lambda s: lambda: s + 1 in ARRIVALS)(step)
        if step in ARRIVALS:
            i = ARRIVALS[step]
            llm.engine.add_request(f"r{i}", prompts[i]["prompt_token_ids"], params)
        done.update((o.request_id, list(o.outputs[0].token_ids))
                    for o in llm.engine.step() if o.finished)
        step += 1
    return done, la


def test_no_forward_is_queued_ahead_of_an_arrival(qwen3_ckpt):
    blind, la0 = _staggered(qwen3_ckpt, watch=False)
    watched, la1 = _staggered(qwen3_ckpt, watch=True)
    assert watched == blind
    assert la0.launched - la0.hits == len(ARRIVALS)  # each arrival dropped a queued forward
    assert la1.launched == la1.hits and la1.held_back == len(ARRIVALS)  # none dropped now
    assert la1.hits > 10  # the rest ran ahead as before


def test_the_async_engine_tells_the_lookahead_what_waits_in_its_inbox(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", device="cpu", decode_lookahead=True)
    aengine = AsyncEngine(llm.engine)
    try:
        arrivals = llm.model.lookahead.arrivals
        assert arrivals is not None and not arrivals()
        aengine.suspend("test: hold the loop so the inbox keeps what arrives")
        aengine.abort("nobody")  # an abort changes the next step's rows too
        assert arrivals()
    finally:
        aengine.shutdown()
