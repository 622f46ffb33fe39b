"""What each SamplingParams field does to the outputs a user of ``LLM.generate`` reads.

Tiny random checkpoints (no tokenizer, EOS id 2) for token-level behaviour; the demo model
(a real byte-level BPE tokenizer and chat template) for text: stop strings, detokenisation,
chat and streaming.
"""

from __future__ import annotations

import math
import random

import pytest

from epserve import LLM, SamplingParams

EOS = 2


def _ids(p: list[int]) -> dict:
    return {"prompt_token_ids": p}


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


@pytest.fixture(scope="module")
def llm(qwen3_ckpt) -> LLM:
    return LLM(model=str(qwen3_ckpt), dtype="float32", seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in (9, 4, 30, 13)]


@pytest.fixture(scope="module")
def demo(demo_model_dir) -> LLM:
    return LLM(model=str(demo_model_dir), seed=0)


# ---------------------------------------------------------------------------- seeds


def test_seeded_request_same_alone_batched_reordered_and_on_another_instance(
        llm, qwen3_ckpt, prompts):
    p, others = prompts[0], prompts[1:]
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(_ids(p), sp)[0].outputs[0].token_ids
    assert len(alone) == 20
    mixed = llm.generate(
        [_ids(others[0]), _ids(others[1]), _ids(p), _ids(others[2])],
        [SamplingParams(temperature=0.8, max_tokens=25), SamplingParams(max_tokens=3), sp,
         SamplingParams(temperature=1.0, seed=5, max_tokens=7)])
    assert mixed[2].outputs[0].token_ids == alone
    reordered = llm.generate([_ids(p), _ids(others[1])], [sp, _greedy(max_tokens=30)])
    assert reordered[0].outputs[0].token_ids == alone
    # Another instance: other engine seed, chunked prefill, small blocks, no prefix cache.
    other = LLM(model=str(qwen3_ckpt), dtype="float32", seed=99, block_size=4,
                max_num_batched_tokens=8, enable_prefix_caching=False)
    outs = other.generate([_ids(others[1]), _ids(p)], [SamplingParams(max_tokens=30), sp])
    assert outs[1].outputs[0].token_ids == alone


def test_seeded_samples_survive_preemption(llm, qwen3_ckpt):
    rng = random.Random(1)
    batch = [_ids([rng.randrange(3, 300) for _ in range(n)]) for n in (3, 7, 12, 5, 21, 30, 9, 40)]
    sps = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=32, ignore_eos=True)
           for i in range(len(batch))]
    want = [o.outputs[0].token_ids for o in llm.generate(batch, sps)]
    small = LLM(model=str(qwen3_ckpt), dtype="float32", block_size=4, num_kv_blocks=24)
    got = [o.outputs[0].token_ids for o in small.generate(batch, sps)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == want


def test_different_seeds_give_different_samples(llm, prompts):
    outs = [llm.generate(_ids(prompts[0]), SamplingParams(temperature=1.0, seed=s, max_tokens=20,
                                                          ignore_eos=True))[0].outputs[0].token_ids
            for s in (1, 2, 3)]
    assert len({tuple(o) for o in outs}) == 3, outs
    greedy = llm.generate(_ids(prompts[0]), _greedy(max_tokens=20, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids not in outs  # temperature 1 really samples


def test_unseeded_requests_follow_the_llm_seed(qwen3_ckpt, prompts):
    def run(seed: int) -> list[list[int]]:
        llm = LLM(model=str(qwen3_ckpt), dtype="float32", seed=seed)
        outs = llm.generate([_ids(p) for p in prompts[:2]],
                            SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]

    first = run(7)
    assert run(7) == first
    assert run(8) != first


# ---------------------------------------------------------------------------- lengths, n


@pytest.mark.parametrize("n_tokens", [1, 5, 17])
def test_max_tokens_gives_that_many_tokens_and_length(llm, prompts, n_tokens):
    out = llm.generate(_ids(prompts[1]), _greedy(max_tokens=n_tokens, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == n_tokens
    assert (c.finish_reason, c.stop_reason) == ("length", None)
    assert out.finished
    longer = llm.generate(_ids(prompts[1]), _greedy(max_tokens=20, ignore_eos=True))[0]
    assert longer.outputs[0].token_ids[:n_tokens] == c.token_ids


def test_max_tokens_none_runs_to_max_model_len(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", max_model_len=24)
    c = llm.generate(_ids([5, 6, 7, 8]), _greedy(max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(c.token_ids) == 20 and c.finish_reason == "length"
    c = llm.generate(_ids([5, 6, 7, 8]), _greedy(max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert len(c.token_ids) == 20 and c.finish_reason == "length"


def test_n_gives_n_indexed_distinct_seeded_samples(llm, prompts):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    out = llm.generate(_ids(prompts[0]), sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert all(len(s) == 10 for s in samples)
    assert len(set(samples)) == 3, samples
    again = llm.generate([_ids(prompts[1]), _ids(prompts[0])], [_greedy(max_tokens=4), sp])[1]
    assert [tuple(c.token_ids) for c in again.outputs] == samples
    greedy = llm.generate(_ids(prompts[0]), _greedy(n=2, max_tokens=10, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


# ---------------------------------------------------------------------------- stops


def _first_new(tokens: list[int], start: int) -> int:
    """The first position >= start whose token did not occur before it."""
    for k in range(start, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return k
    raise AssertionError(f"no token first occurs at or after {start} in {tokens}")


def test_stop_token_id_ends_there_and_is_kept_in_token_ids(llm, prompts):
    g = llm.generate(_ids(prompts[0]), _greedy(max_tokens=16, ignore_eos=True))[0].outputs[0]
    k = _first_new(g.token_ids, 2)
    t = g.token_ids[k]
    c = llm.generate(_ids(prompts[0]), _greedy(max_tokens=16, stop_token_ids=[t],
                                               ignore_eos=True))[0].outputs[0]
    assert c.token_ids == g.token_ids[:k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", t)


def test_min_tokens_holds_back_a_stop_token(llm, prompts):
    g = llm.generate(_ids(prompts[0]), _greedy(max_tokens=16, ignore_eos=True))[0].outputs[0]
    k = _first_new(g.token_ids, 2)
    t = g.token_ids[k]
    # min_tokens = k: the stop id is only banned where greedy did not pick it anyway.
    c = llm.generate(_ids(prompts[0]), _greedy(max_tokens=16, stop_token_ids=[t], min_tokens=k,
                                               ignore_eos=True))[0].outputs[0]
    assert c.token_ids == g.token_ids[:k + 1] and c.finish_reason == "stop"
    # min_tokens = k + 2: stopping at k + 1 tokens is not allowed any more.
    c = llm.generate(_ids(prompts[0]), _greedy(max_tokens=16, stop_token_ids=[t],
                                               min_tokens=k + 2, ignore_eos=True))[0].outputs[0]
    assert t not in c.token_ids[:k + 2]
    assert len(c.token_ids) >= k + 2
    if c.finish_reason == "stop":
        assert c.token_ids[-1] == t and c.stop_reason == t
    else:
        assert c.finish_reason == "length" and len(c.token_ids) == 16


@pytest.fixture(scope="module")
def eos_prompt(llm) -> list[int]:
    """A prompt whose greedy next token is EOS (id 2), found among random prompts."""
    rng = random.Random(0)
    cands = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 12))] for _ in range(600)]
    outs = llm.generate([_ids(p) for p in cands], _greedy(max_tokens=1, ignore_eos=True))
    for p, o in zip(cands, outs):
        if o.outputs[0].token_ids == [EOS]:
            return p
    raise AssertionError("no random prompt continues with EOS greedily")


def test_eos_stops_unless_ignore_eos(llm, eos_prompt):
    c = llm.generate(_ids(eos_prompt), _greedy(max_tokens=8))[0].outputs[0]
    assert c.token_ids == [EOS]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    c = llm.generate(_ids(eos_prompt), _greedy(max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert c.token_ids[0] == EOS and len(c.token_ids) == 8 and c.finish_reason == "length"


def test_min_tokens_holds_back_eos(llm, eos_prompt):
    c = llm.generate(_ids(eos_prompt), _greedy(max_tokens=8, min_tokens=3))[0].outputs[0]
    assert len(c.token_ids) >= 3
    assert EOS not in c.token_ids[:3]
    if c.finish_reason == "stop":
        assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
    else:
        assert c.finish_reason == "length" and len(c.token_ids) == 8


# ---------------------------------------------------------------------------- logprobs


def _check_position(d: dict, chosen: int, k: int) -> None:
    assert chosen in d and list(d)[0] == chosen and d[chosen].rank >= 1
    outside = d[chosen].rank > k  # then its real rank (vLLM's), and k + 1 entries
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in d.items()
                    if not (outside and tid == chosen))
    assert [r for r, _, _ in ranked] == list(range(1, k + 1))
    assert len(d) == k + outside
    values = [v for _, _, v in ranked]
    assert values == sorted(values, reverse=True)
    assert all(lp.logprob <= 0.0 for lp in d.values())
    assert sum(math.exp(lp.logprob) for lp in d.values()) <= 1.0 + 1e-5
    if outside:  # not more likely than the k-th
        assert d[chosen].logprob <= values[-1] + 1e-6


def test_logprobs_greedy(llm, prompts):
    c = llm.generate(_ids(prompts[0]), _greedy(max_tokens=10, ignore_eos=True, logprobs=3))[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 10
    for t, d in zip(c.token_ids, c.logprobs):
        _check_position(d, t, 3)
        assert d[t].rank == 1  # greedy takes the most likely token
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)))
    plain = llm.generate(_ids(prompts[0]), _greedy(max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert plain.token_ids == c.token_ids  # asking for logprobs changes no token


def test_logprobs_sampled_and_zero(llm, prompts):
    sp = SamplingParams(temperature=1.5, seed=11, max_tokens=12, ignore_eos=True, logprobs=2)
    c = llm.generate(_ids(prompts[2]), sp)[0].outputs[0]
    for t, d in zip(c.token_ids, c.logprobs):
        _check_position(d, t, 2)
    c0 = llm.generate(_ids(prompts[2]), SamplingParams(temperature=1.5, seed=11, max_tokens=12,
                                                       ignore_eos=True, logprobs=0))[0].outputs[0]
    assert c0.token_ids == c.token_ids
    assert [list(d) for d in c0.logprobs] == [[t] for t in c.token_ids]
    assert [d[t].logprob for t, d in zip(c0.token_ids, c0.logprobs)] == pytest.approx(
        [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)])


def test_prompt_logprobs_shape_and_agree_with_sampled_logprobs(llm, prompts):
    p = prompts[1]
    g = llm.generate(_ids(p), _greedy(max_tokens=6, ignore_eos=True, logprobs=2))[0].outputs[0]
    full = p + g.token_ids
    out = llm.generate(_ids(full), _greedy(max_tokens=1, prompt_logprobs=2))[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(full) and plp[0] is None
    for i in range(1, len(full)):
        _check_position(plp[i], full[i], 2)
    # Teacher-forcing the greedy tokens scores them as the generation did.
    for j, t in enumerate(g.token_ids):
        assert plp[len(p) + j][t].logprob == pytest.approx(g.logprobs[j][t].logprob, abs=1e-4)
    none = llm.generate(_ids(full), _greedy(max_tokens=1))[0]
    assert none.prompt_logprobs is None


# ---------------------------------------------------------------------------- filters


def test_temperature_zero_equals_top_k_1_top_p_tiny_min_p_1(llm, prompts):
    batch = [_ids(p) for p in prompts]
    want = [o.outputs[0].token_ids
            for o in llm.generate(batch, _greedy(max_tokens=12, ignore_eos=True))]
    for sp in (SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=1e-9, seed=3, max_tokens=12, ignore_eos=True),
               SamplingParams(temperature=2.0, min_p=1.0, max_tokens=12, ignore_eos=True),
               SamplingParams(temperature=1e-6, max_tokens=12, ignore_eos=True)):
        got = [o.outputs[0].token_ids for o in llm.generate(batch, sp)]
        assert got == want, sp
    sampled = [o.outputs[0].token_ids for o in llm.generate(
        batch, SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))]
    assert sampled != want


def test_top_k_samples_only_among_the_top_k(llm, prompts):
    sp = SamplingParams(temperature=5.0, top_k=2, seed=1, max_tokens=16, ignore_eos=True,
                        logprobs=2)
    c = llm.generate(_ids(prompts[0]), sp)[0].outputs[0]
    ranks = [d[t].rank for t, d in zip(c.token_ids, c.logprobs)]
    assert set(ranks) <= {1, 2}
    assert 2 in ranks  # a hot temperature does pick the second one sometimes


# ---------------------------------------------------------------------------- text (demo)


def test_demo_text_equals_decode_of_token_ids(demo):
    tok = demo.get_tokenizer()
    outs = demo.generate(["The experts said", "Once upon a time"],
                         _greedy(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(["The experts said", "Once upon a time"], outs):
        c = out.outputs[0]
        assert out.prompt == prompt
        assert out.prompt_token_ids == tok.encode(prompt)
        assert c.finish_reason == "length" and len(c.token_ids) == 24
        assert c.text and c.text == tok.decode(c.token_ids)


def test_demo_stop_string_cuts_text(demo):
    tok = demo.get_tokenizer()
    prompt = "The experts said"
    full = demo.generate(prompt, _greedy(max_tokens=32, ignore_eos=True))[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    k = text.find(stop)
    assert k > 0
    c = demo.generate(prompt, _greedy(max_tokens=32, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert c.text == text[:k]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    # Generation stopped at the token that completed the stop string.
    assert c.token_ids == full.token_ids[:len(c.token_ids)]
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
    inc = demo.generate(prompt, _greedy(max_tokens=32, ignore_eos=True, stop=[stop],
                                        include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == text[:k + len(stop)]
    assert (inc.finish_reason, inc.stop_reason) == ("stop", stop)
    assert inc.token_ids == c.token_ids
    never = demo.generate(prompt, _greedy(max_tokens=32, ignore_eos=True,
                                          stop=["\x00never\x00"]))[0].outputs[0]
    assert (never.text, never.finish_reason) == (text, "length")


@pytest.mark.parametrize("min_tokens", [0, 1, 3])
def test_demo_min_tokens_protects_the_first_tokens_from_stop_strings(demo, min_tokens):
    """vLLM's rule: stop strings count once there are more than min_tokens tokens, so the
    text of the first min_tokens tokens is never cut (a logit bias makes every token '#')."""
    hash_id = demo.get_tokenizer().convert_tokens_to_ids("#")
    c = demo.generate("x", _greedy(max_tokens=6, min_tokens=min_tokens, stop=["#"],
                                   logit_bias={hash_id: 100.0}))[0].outputs[0]
    assert c.text == "#" * min_tokens
    assert len(c.token_ids) == min_tokens + 1 and set(c.token_ids) == {hash_id}
    assert (c.finish_reason, c.stop_reason) == ("stop", "#")


def test_demo_chat_prompt_is_the_rendered_template(demo):
    tok = demo.get_tokenizer()
    conv = [{"role": "user", "content": "hi"}]
    out = demo.chat(conv, _greedy(max_tokens=8, ignore_eos=True))[0]
    rendered = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered and "hi" in rendered
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert out.prompt_token_ids == list(ids)
    c = out.outputs[0]
    assert len(c.token_ids) == 8 and c.text == tok.decode(c.token_ids)
    same = demo.generate(_ids(out.prompt_token_ids), _greedy(max_tokens=8, ignore_eos=True))[0]
    assert same.outputs[0].token_ids == c.token_ids
    two = demo.chat([conv, [{"role": "user", "content": "Tell me a story"}]],
                    _greedy(max_tokens=8, ignore_eos=True))
    assert len(two) == 2 and two[0].outputs[0].token_ids == c.token_ids


def test_demo_stop_token_text_left_out_unless_asked(demo):
    tok = demo.get_tokenizer()
    prompt = "The experts said"
    g = demo.generate(prompt, _greedy(max_tokens=16, ignore_eos=True))[0].outputs[0]
    k = _first_new(g.token_ids, 2)
    t = g.token_ids[k]
    c = demo.generate(prompt, _greedy(max_tokens=16, stop_token_ids=[t]))[0].outputs[0]
    assert c.token_ids == g.token_ids[:k + 1] and c.stop_reason == t
    assert c.text == tok.decode(g.token_ids[:k]) and tok.decode([t]) != ""
    inc = demo.generate(prompt, _greedy(max_tokens=16, stop_token_ids=[t],
                                        include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == tok.decode(g.token_ids[:k + 1])


@pytest.mark.parametrize("stop", [None, "stop-string"])
def test_demo_stream_grows_to_the_generate_text(demo, stop):
    prompt = "Once upon a time"
    base = _greedy(max_tokens=24, ignore_eos=True)
    if stop:
        text = demo.generate(prompt, base)[0].outputs[0].text
        stop = text[10:13]
    sp = _greedy(max_tokens=24, ignore_eos=True, stop=stop)
    want = demo.generate(prompt, sp)[0].outputs[0]
    steps = list(demo.stream(prompt, sp))
    assert len(steps) >= 2
    assert all(not s.finished for s in steps[:-1]) and steps[-1].finished
    texts = [s.outputs[0].text for s in steps]
    ids = [s.outputs[0].token_ids for s in steps]
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a)  # streamed text is never taken back
    for a, b in zip(ids, ids[1:]):
        assert len(b) > len(a) and b[:len(a)] == a
    assert texts[-1] == want.text and ids[-1] == want.token_ids
    assert steps[-1].outputs[0].finish_reason == want.finish_reason
    assert not demo.engine.has_unfinished()
