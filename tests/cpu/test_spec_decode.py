"""Speculative decoding as a user of the offline API sees it: with an n-gram proposer the output
is the output without speculation, token for token (greedy) and draw for draw (seeded), with
its logprobs, whatever the batch goes through (chunked prefill, prefix hits, preemption, stop
ids, max_tokens inside a drafted run); speculation shows only in fewer steps and its counters.
A bad ``speculative_config`` is refused at start, naming the key."""

from __future__ import annotations

import random

import pytest

from epserve import LLM, SamplingParams
from epserve.models.traits import RowSampling, VerifyBatchedOpts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def _prompts() -> list[list[int]]:
    """Random prompts, and prompts that repeat a phrase (lookup drafts from them)."""
    rng = random.Random(5)
    out = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 9, 17, 26)]
    for n in (3, 5, 8):
        phrase = [rng.randrange(3, 300) for _ in range(n)]
        out.append(phrase * 4)
    return out


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", seed=0, max_model_len=128, **kw)


def _same(want, got, atol: float = 1e-5) -> None:
    """Same tokens and finish; logprobs within ``atol`` (a verify's rows share their step with
    other rows, so fp32 sums may run in another order: measured up to 5e-6, as chunked against
    unchunked prefill without speculation)."""
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w.outputs, g.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason
            if a.logprobs is not None:
                for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                    assert la.keys() == lb.keys()
                    for t in la:
                        assert la[t].logprob == pytest.approx(lb[t].logprob, abs=atol)


CASES = {  # engine options: the paths a batch may take
    "plain": {},
    "chunked": {"max_num_batched_tokens": 16},
    "preempting": {"num_kv_blocks": 12, "block_size": 4},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_output_is_unchanged_by_ngram_speculation(tiny_ckpt, case):
    prompts = _prompts()
    prompts += [prompts[-1], prompts[-1][:10] + [7, 8]]  # prefix-cache hits
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    want = _llm(tiny_ckpt, **CASES[case]).generate(reqs, sp)
    spec = _llm(tiny_ckpt, speculative_config=NGRAM, **CASES[case])
    got = spec.generate(reqs, sp)
    _same(want, got)
    st = spec.engine.stats.spec
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens <= st.num_draft_tokens
    per = st.accepted_per_pos
    assert per == sorted(per, reverse=True) and sum(per) == st.num_accepted_tokens
    if case == "preempting":
        assert spec.engine.scheduler.num_preemptions > 0


def test_seeded_sampling_stops_and_max_tokens_are_unchanged(qwen3_ckpt):
    """Seeded draws, stop ids, min_tokens and max_tokens that end inside a drafted run give
    what they give without speculation."""
    prompts = _prompts()
    reqs = [{"prompt_token_ids": p} for p in prompts]
    base, spec = _llm(qwen3_ckpt), _llm(qwen3_ckpt, speculative_config=NGRAM)
    sampled = SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=30, ignore_eos=True,
                             logprobs=1, n=2)
    _same(base.generate(reqs, sampled), spec.generate(reqs, sampled))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = [o.outputs[0].token_ids for o in base.generate(reqs, greedy)]
    stop = full[-1][9]  # a token the repeating prompt's output reaches mid-run
    for sp in (SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 13)):
        _same(base.generate(reqs, sp), spec.generate(reqs, sp))
    sp = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], min_tokens=5)
    want, got = base.generate(reqs, sp), spec.generate(reqs, sp)
    _same(want, got)
    assert got[-1].outputs[0].finish_reason == "stop"
    assert spec.engine.stats.spec.num_accepted_tokens > 0


def test_drafts_equal_to_the_targets_own_tokens_are_all_accepted(qwen3_ckpt):
    """A verify of the target's own greedy continuation accepts every draft: k + 1 tokens per
    verify step, and the sequence goes on exactly as without speculation."""
    llm = _llm(qwen3_ckpt)
    prompt = [5, 9, 33, 41, 7, 12]
    want = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
    m = llm.model
    seq = m.alloc_sequence_for(64, prompt)
    seq.sampling, seq.prompt_len = RowSampling(temperature=0.0), len(prompt)
    assert m.reserve_blocks(seq, len(prompt))
    got = [m.prefill(prompt, seq).token_id]
    steps = 0
    for k in (4, 3, 4, 2):
        seq.output_index = len(got)
        assert m.reserve_blocks(seq, seq.seq_len + 1 + k)
        drafts = want[len(got):len(got) + k]
        run = m.decode_verify_batched([got[-1], *drafts], [k], [seq])[0]
        assert [t.token_id for t in run] == want[len(got):len(got) + k + 1]
        got += [t.token_id for t in run]
        steps += 1
        assert seq.seq_len == len(prompt) + len(got) - 1
    assert steps == 4 and len(got) == 1 + sum(k + 1 for k in (4, 3, 4, 2))
    seq.output_index = len(got)
    assert m.reserve_blocks(seq, seq.seq_len + 1)
    assert m.decode(got[-1], seq).token_id == want[len(got)]
    with pytest.raises(ValueError, match="write_on_accept"):
        m.decode_verify_batched([got[-1]], [0], [seq], VerifyBatchedOpts(write_on_accept=True))
    m.free_sequence(seq)


def test_a_rejected_tail_gives_its_blocks_back(qwen3_ckpt):
    """Blocks past the accepted length return to the pool at once."""
    llm = _llm(qwen3_ckpt, block_size=4)
    m = llm.model
    prompt = [5, 9, 33, 41, 7, 12, 3]
    seq = m.alloc_sequence_for(64, prompt)
    seq.sampling, seq.prompt_len = RowSampling(temperature=0.0), len(prompt)
    assert m.reserve_blocks(seq, len(prompt))
    first = m.prefill(prompt, seq).token_id
    free = m.num_free_blocks()
    seq.output_index = 1
    assert m.reserve_blocks(seq, seq.seq_len + 1 + 8)  # positions 7..15: two more blocks
    assert m.num_free_blocks() == free - 2
    bad = 1 if first != 1 else 2  # a draft the target is all but sure not to pick first
    run = m.decode_verify_batched([first] + [bad] * 8, [8], [seq])[0]
    assert run[0].token_id != bad and seq.seq_len == len(prompt) + 1
    assert len(seq.block_table) == 2 and m.num_free_blocks() == free
    m.free_sequence(seq)


@pytest.mark.parametrize("bad,key", [
    ({"method": "mtp", "num_speculative_tokens": 2}, "method='mtp'.*no MTP head"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such"}, "model"),
    ({"method": "bogus", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
])
def test_a_bad_speculative_config_is_refused_at_start(qwen3_ckpt, bad, key):
    with pytest.raises(ValueError, match=key):
        _llm(qwen3_ckpt, speculative_config=bad)


def test_the_prefix_cache_holds_only_accepted_tokens(qwen3_ckpt):
    """Blocks a speculative run caches cover its accepted output only: a prompt that
    continues a finished output hits them and goes on as without speculation."""
    phrase = [11, 12, 13, 14, 15]
    first = {"prompt_token_ids": phrase * 4}
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base, spec = _llm(qwen3_ckpt, block_size=4), _llm(qwen3_ckpt, speculative_config=NGRAM,
                                                       block_size=4)
    out = spec.generate([first], sp)[0].outputs[0].token_ids
    assert out == base.generate([first], sp)[0].outputs[0].token_ids
    assert spec.engine.stats.spec.num_accepted_tokens > 0
    longer = {"prompt_token_ids": phrase * 4 + out[:30]}
    want = base.generate([longer], sp)[0]
    got = spec.generate([longer], sp)[0]
    assert got.num_cached_tokens >= 44  # the prompt and most of the output: blocks of 4
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_stop_strings_cut_a_drafted_run_where_they_would_without_it(demo_model_dir):
    """The demo model (a real tokenizer): a stop string that the output reaches mid-run ends
    the text at the same place, with the same tokens, as without speculation."""
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    common = dict(model=str(demo_model_dir), dtype="float32", seed=0)
    base = LLM(**common)
    spec = LLM(**common, speculative_config=NGRAM)
    full = base.generate([prompt], SamplingParams(temperature=0.0, max_tokens=48,
                                                  ignore_eos=True))[0].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop])
    want, got = base.generate([prompt], sp)[0].outputs[0], spec.generate([prompt], sp)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        want.text, want.token_ids, "stop", stop)
    assert spec.engine.stats.spec.num_drafts > 0
