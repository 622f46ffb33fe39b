"""What a user of the offline API sees, checked against transformers fp32 on the CPU.

Greedy continuations must be token-identical and logprobs within 1e-4, for both architectures,
batched, with chunked prefill forced, with prefix-cache hits, with a KV pool small enough to
preempt, and with requests arriving while others run.
"""

from __future__ import annotations

import random

import pytest

from epserve import LLM, SamplingParams
from oracle import hf_greedy, hf_prompt_logprobs

NEW = 32
ATOL = 1e-4


def _prompts(vocab: int = 300, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 7, 12, 5, 21, 30, 9, 40]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _greedy(logprobs: int | None = 0, prompt_logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)


def _check_against_hf(path, prompts, outs) -> None:
    assert len(outs) == len(prompts)
    for p, out in zip(prompts, outs):
        assert out.prompt_token_ids == p
        want_ids, want_lps = hf_greedy(path, p, NEW)
        got = out.outputs[0]
        assert got.token_ids == want_ids, f"prompt of {len(p)} tokens diverged"
        assert got.finish_reason == "length"
        got_lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert got_lps == pytest.approx(want_lps, abs=ATOL)


def test_batched_greedy_matches_transformers(tiny_ckpt):
    prompts = _prompts()
    llm = LLM(model=str(tiny_ckpt), dtype="float32", seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(prompt_logprobs=2))
    _check_against_hf(tiny_ckpt, prompts, outs)
    for p, out in zip(prompts, outs):
        want = hf_prompt_logprobs(tiny_ckpt, p, k=2)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(p)
        for pos, (lp, top) in enumerate(want, start=1):
            entry = out.prompt_logprobs[pos]
            assert entry[p[pos]].logprob == pytest.approx(lp, abs=ATOL)
            for tid, tlp in top:
                assert entry[tid].logprob == pytest.approx(tlp, abs=ATOL)


def test_chunked_prefill_same_output(qwen3_ckpt):
    prompts = _prompts()
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", max_num_batched_tokens=16,
              long_prefill_token_threshold=8)
    _check_against_hf(qwen3_ckpt, prompts, llm.generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy()))


def test_prefix_cache_hits_same_output(mixtral_ckpt):
    rng = random.Random(7)
    shared = [rng.randrange(3, 300) for _ in range(37)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(n)] for n in (1, 4, 9)]
    llm = LLM(model=str(mixtral_ckpt), dtype="float32", block_size=4)
    llm.generate([{"prompt_token_ids": prompts[0]}], _greedy())
    free_before = llm.model.num_free_blocks()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    _check_against_hf(mixtral_ckpt, prompts, outs)
    assert all(o.num_cached_tokens >= 36 for o in outs), [o.num_cached_tokens for o in outs]
    assert llm.model.num_free_blocks() <= free_before  # blocks stay cached for reuse


def test_small_kv_pool_preempts_and_resumes_identically(tiny_ckpt):
    prompts = _prompts()
    # 8 prompts of up to 40 + 32 tokens need ~ 60 blocks of 4; 24 forces preemption.
    llm = LLM(model=str(tiny_ckpt), dtype="float32", block_size=4, num_kv_blocks=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    _check_against_hf(tiny_ckpt, prompts, outs)
    assert llm.model.num_free_blocks() + llm.model.pool.num_cached_free_blocks() == 24


def test_requests_arriving_mid_run(qwen3_ckpt):
    prompts = _prompts(seed=3)
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", max_num_batched_tokens=32)
    eng = llm.engine
    finished = {}
    order = []
    for i, p in enumerate(prompts):
        order.append(eng.add_request(f"r{i}", p, _greedy()).request_id)
        for _ in range(3):  # a few steps between arrivals
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    _check_against_hf(qwen3_ckpt, prompts, [finished[r] for r in order])


def test_tight_pool_with_prefix_hits_and_small_chunks_does_not_stall(qwen3_ckpt):
    """A pool so small that a new prompt's first chunk only fits after shrinking it, with
    shared prefixes and capped chunks: every request finishes, with transformers' tokens."""
    import threading

    rng = random.Random(5)
    shared = [rng.randrange(3, 300) for _ in range(13)]
    own = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 9, 17, 4, 28, 6, 11, 22)]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(own)]
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=24, long_prefill_token_threshold=8)
    box = {}
    th = threading.Thread(target=lambda: box.setdefault("outs", llm.generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy())), daemon=True)
    th.start()
    th.join(timeout=120)
    assert not th.is_alive(), "generate stalled"
    _check_against_hf(qwen3_ckpt, prompts, box["outs"])


def test_step_finished_only_reports_each_request_once_when_it_ends(qwen3_ckpt):
    # what LLM.generate reads: no cumulative output of running requests, the same final ones
    prompts = _prompts(seed=4)[:3]
    llm = LLM(model=str(qwen3_ckpt), dtype="float32")
    eng = llm.engine
    ids = [eng.add_request(f"f{i}", p, _greedy()).request_id for i, p in enumerate(prompts)]
    seen = []
    while eng.has_unfinished():
        outs = eng.step(finished_only=True)
        assert all(o.finished for o in outs)
        seen += outs
    assert sorted(o.request_id for o in seen) == sorted(ids)
    by_id = {o.request_id: o for o in seen}
    _check_against_hf(qwen3_ckpt, prompts, [by_id[r] for r in ids])
