"""Aborts as a user of the offline API sees them: an aborted request ends with its tokens so
far and gives its KV cache back, the others run on, a closed stream aborts its request, and
aborts are counted."""

from __future__ import annotations

from epserve import LLM
from llm_kit import _greedy, _ids, _idle, _within


def test_abort_mid_generation_frees_kv_and_spares_the_others(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", block_size=4, num_kv_blocks=32)
    eng = llm.engine
    keep_params = _greedy(max_tokens=10, ignore_eos=True)
    want = llm.generate(_ids([11, 12, 13]), keep_params)[0].outputs[0].token_ids
    eng.add_request("victim", list(range(3, 20)), _greedy(max_tokens=30, ignore_eos=True))
    eng.add_request("keep", [11, 12, 13], keep_params)
    outs = []
    for _ in range(3):
        outs += eng.step()
    assert [o for o in outs if o.request_id == "victim"][-1].outputs[0].token_ids  # it ran
    used = llm.model.num_total_blocks() - llm.model.num_free_blocks() - llm.model.pool.num_cached_free_blocks()
    assert used > 0
    eng.abort_request("victim")
    eng.abort_request("victim")  # twice, or an unknown id: nothing happens
    eng.abort_request("no-such-request")
    assert "victim" not in eng.requests
    after = []
    while eng.has_unfinished():
        after += eng.step()
    for o in after:
        if o.request_id == "victim":
            assert o.outputs[0].finish_reason == "abort"
    keep = [o for o in after if o.request_id == "keep"][-1]
    assert keep.finished and keep.outputs[0].token_ids == want
    _idle(llm)


def test_abort_of_a_waiting_request_and_of_everything(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", block_size=4, num_kv_blocks=32)
    eng = llm.engine
    for i in range(3):
        eng.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], _greedy(max_tokens=20, ignore_eos=True))
    eng.abort_request("r2")  # still waiting: never runs
    seen = set()
    for _ in range(2):
        seen |= {o.request_id for o in eng.step()}
    assert "r2" not in seen
    for rid in ("r0", "r1"):
        eng.abort_request(rid)
    assert not eng.has_unfinished()
    assert eng.step() == []
    _idle(llm)


def test_stream_closed_early_aborts_its_request(llm):
    it = llm.stream(_ids([5, 6, 7]), _greedy(max_tokens=30, ignore_eos=True))
    first = next(it)
    assert not first.finished
    assert llm.engine.has_unfinished()
    it.close()
    _idle(llm)
    unstarted = llm.stream(_ids([5, 6, 7]), _greedy(max_tokens=30))
    del unstarted  # never iterated: nothing was queued
    _idle(llm)


def test_stream_finished_by_another_call_ends_instead_of_hanging(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32")  # its own: a hang leaves a busy thread
    sp = _greedy(max_tokens=4, ignore_eos=True)
    want = llm.generate(_ids([5, 6, 7]), sp)[0].outputs[0]
    it = llm.stream(_ids([5, 6, 7]), sp)
    next(it)
    # generate() drives the engine to the end, finishing the suspended stream's request too.
    llm.generate(_ids([8, 9]), _greedy(max_tokens=10, ignore_eos=True))
    rest = _within(30, list, it)
    assert rest and rest[-1].finished
    assert rest[-1].outputs[0].token_ids == want.token_ids
    assert rest[-1].outputs[0].finish_reason == "length"
    _idle(llm)


def test_abort_mid_chunked_prefill_then_the_prompt_reuses_its_blocks(qwen3_ckpt):
    prompt = list(range(5, 45))
    sp = _greedy(max_tokens=8, ignore_eos=True)
    want = LLM(model=str(qwen3_ckpt), dtype="float32").generate(_ids(prompt), sp)[0].outputs[0]
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", block_size=4, max_num_batched_tokens=6,
              num_kv_blocks=20)
    eng = llm.engine
    eng.add_request("a", prompt, sp)
    for _ in range(3):
        assert eng.step() == []  # prefill chunks: nothing to show yet
    eng.abort_request("a")
    _idle(llm)
    out = llm.generate(_ids(prompt), sp)[0]
    assert out.outputs[0].token_ids == want.token_ids
    assert out.num_cached_tokens == 16  # the 4 full blocks the aborted chunks computed
    _idle(llm)


def test_aborted_requests_are_counted_in_the_finished_stats(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32")
    eng = llm.engine
    eng.add_request("a", [5, 6, 7], _greedy(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.abort_request("a")
    assert eng.stats.finished.get("abort") == 1
