"""vLLM's order of a position's logprobs, as the openai client reads it: the sampled (or prompt)
token first, then the top k. Completions list the whole dict (k + 1 entries when the sampled
token is not among the top k); chat's ``top_logprobs`` are its first k entries, so the sampled
token and the k - 1 most likely others. Sampled at temperature 1 on the random demo model, the
sampled token is rarely among the top 2: the order is visible. Token strings are
``token_id:<id>`` so that two tokens that decode alike stay two keys. A token outside the top k
carries its real rank (vLLM's)."""

from __future__ import annotations

import pytest

from epserve import SamplingParams

PROMPT = "The experts said"
CHAT = [{"role": "user", "content": "Tell me a story"}]
IDS = {"return_tokens_as_token_ids": True}
SAMPLED = dict(temperature=1.0, seed=3, max_tokens=8)


def _keys(pos) -> list[str]:
    return [f"token_id:{t}" for t in pos]


def _descending(values) -> bool:
    return all(a >= b for a, b in zip(values, values[1:]))


def test_completion_top_logprobs_start_with_the_sampled_token(client, server, offline_llm):
    want = offline_llm.generate(PROMPT, SamplingParams(**SAMPLED, logprobs=2))[0].outputs[0]
    r = client.completions.create(model=server.model, prompt=PROMPT, logprobs=2, **SAMPLED,
                                  extra_body=IDS)
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in want.token_ids]
    outside = 0
    for token, token_lp, top, pos in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                         want.logprobs):
        assert list(top) == _keys(pos)  # the offline dict's order, key for key
        assert list(top)[0] == token and top[token] == pytest.approx(token_lp, abs=1e-4)
        assert _descending(list(top.values())[1:])  # then the top k, most likely first
        outside += len(top) == 3
    assert outside, "no sampled token fell outside the top 2: the order was not exercised"
    streamed = [t for ch in client.completions.create(
        model=server.model, prompt=PROMPT, logprobs=2, stream=True, **SAMPLED, extra_body=IDS)
        for c in ch.choices if c.logprobs for t in c.logprobs.top_logprobs]
    assert [list(t.items()) for t in streamed] == [list(t.items()) for t in lp.top_logprobs]


def test_chat_top_logprobs_start_with_the_sampled_token(client, server, offline_llm):
    want = offline_llm.chat(CHAT, SamplingParams(**SAMPLED, logprobs=2))[0].outputs[0]
    r = client.chat.completions.create(model=server.model, messages=CHAT, logprobs=True,
                                       top_logprobs=2, **SAMPLED, extra_body=IDS)
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [f"token_id:{t}" for t in want.token_ids]
    outside = 0
    for entry, tid, pos in zip(content, want.token_ids, want.logprobs):
        tops = [(t.token, t.logprob) for t in entry.top_logprobs]
        assert [t for t, _ in tops] == _keys(pos)[:2]  # the first 2 of vLLM's dict
        assert tops[0] == (entry.token, entry.logprob)
        rank = pos[tid].rank  # its place in the top 2, else its real rank (vLLM's)
        outside += rank > 2
        if rank > 2:  # not in the top 2: the single other is the most likely
            assert pos[int(tops[1][0].split(":")[1])].rank == 1
    assert outside, "no sampled token fell outside the top 2: the order was not exercised"
    stream = client.chat.completions.create(model=server.model, messages=CHAT, logprobs=True,
                                            top_logprobs=2, stream=True, **SAMPLED,
                                            extra_body=IDS)
    streamed = [e for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in content]


def test_prompt_logprobs_start_with_the_prompt_token(client, server, offline_llm):
    want = offline_llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for pos, tid, offline in zip(got[1:], want.prompt_token_ids[1:], want.prompt_logprobs[1:]):
        assert list(pos) == [str(t) for t in offline]
        assert list(pos)[0] == str(tid)
        ranks = [e["rank"] for e in list(pos.values())[1:]]
        assert None not in ranks and ranks == sorted(ranks)  # then the top k in rank order


def test_prompt_logprobs_carry_the_real_rank(client, server, offline_llm, demo_model_dir):
    """A prompt token outside the top k shows its real rank, as vLLM's: the count of vocabulary
    tokens at least as likely, here from transformers' fp32 logits of the same checkpoint."""
    import torch
    from oracle import hf_model

    ids = offline_llm.get_tokenizer().encode(PROMPT)
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1,
                                  extra_body={"prompt_logprobs": 1})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    with torch.inference_mode():
        lp = torch.log_softmax(hf_model(str(demo_model_dir))(torch.tensor([ids])).logits[0], -1)
    ranks = []
    for i, pos in enumerate(got[1:], start=1):
        want = int((lp[i - 1] >= lp[i - 1, ids[i]]).sum())
        assert list(pos)[0] == str(ids[i]) and pos[str(ids[i])]["rank"] == want, i
        assert sorted(e["rank"] for e in pos.values()) == ([1] if want == 1 else [1, want])
        ranks.append(want)
    assert any(rank > 1 for rank in ranks), ranks  # outside the top 1: not only its place


def test_an_echoed_prompt_shows_logprobs_plus_one_entries(client, server):
    """vLLM's cap for the echoed prompt's positions: the prompt token and the top k of
    ``logprobs``, even when ``prompt_logprobs`` asked the engine for more."""
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, echo=True,
                                  logprobs=1, temperature=0,
                                  extra_body={**IDS, "prompt_logprobs": 3})
    choice = r.choices[0]
    plps = choice.model_extra["prompt_logprobs"]
    lp = choice.logprobs
    n = len(plps)
    assert lp.top_logprobs[0] is None and plps[0] is None
    for token, top, full in zip(lp.tokens[1:n], lp.top_logprobs[1:n], plps[1:]):
        assert 1 <= len(top) <= 2 < len(full) <= 4
        assert list(top)[0] == token == f"token_id:{list(full)[0]}"
        assert list(top) == [f"token_id:{t}" for t in full][:len(top)]
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[n:])  # the generated tokens
