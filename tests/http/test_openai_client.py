"""The official openai client against the live server: what it returns equals the offline
LLM API on the same folder (greedy, or seeded sampling), streamed or not."""

from __future__ import annotations

import math

import pytest

from epserve import SamplingParams

PROMPT = "The experts said"
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What time is it?"}]


def _offline(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0]


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons per choice index, and every chunk, of a completions stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(stream)
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in reasons, "a choice finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, chunks


def test_models_lists_the_served_model(client, server):
    ids = [m.id for m in client.models.list().data]
    assert ids == [server.model]


def test_completion_greedy_matches_offline(client, server, offline_llm):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12,
                                  temperature=0)
    want = _offline(offline_llm, PROMPT, temperature=0, max_tokens=12)
    c = r.choices[0]
    assert c.text == want.outputs[0].text
    assert c.finish_reason in ("stop", "length")
    assert c.finish_reason == want.outputs[0].finish_reason
    assert r.object == "text_completion" and r.model == server.model
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_matches_and_ends_with_usage(client, server, offline_llm):
    stream = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, reasons, chunks = _stream_text(stream)
    want = _offline(offline_llm, PROMPT, temperature=0, max_tokens=12)
    assert texts == {0: want.outputs[0].text}
    assert reasons == {0: want.outputs[0].finish_reason}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert last.usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(ch.usage is None for ch in chunks[:-1])


def test_token_id_prompts_and_batches(client, server, offline_llm):
    ids = offline_llm.get_tokenizer().encode("Hello world")
    r = client.completions.create(model=server.model, prompt=[ids, ids[:2]], max_tokens=6,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, [ids, ids[:2]]):
        want = offline_llm.generate({"prompt_token_ids": p},
                                    SamplingParams(temperature=0, max_tokens=6))[0]
        assert c.text == want.outputs[0].text


def test_seeded_sampling_n_is_reproducible_and_matches_offline(client, server, offline_llm):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=10, temperature=0.9, top_p=0.95,
              n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    want = _offline(offline_llm, PROMPT, temperature=0.9, top_p=0.95, n=3, seed=1234,
                    max_tokens=10)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    by_index = {c.index: c.text for c in a.choices}
    assert by_index == {o.index: o.text for o in want.outputs}
    assert len(set(by_index.values())) > 1, "n=3 samples should differ"
    streamed, _, _ = _stream_text(client.completions.create(**kw, stream=True))
    assert streamed == by_index


def test_completion_logprobs_match_offline(client, server, offline_llm):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6,
                                  temperature=0, logprobs=3)
    want = _offline(offline_llm, PROMPT, temperature=0, max_tokens=6, logprobs=3).outputs[0]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(want.token_ids) == len(lp.token_logprobs) == len(lp.top_logprobs)
    for i, tid in enumerate(want.token_ids):
        assert math.isclose(lp.token_logprobs[i], want.logprobs[i][tid].logprob, abs_tol=1e-4)
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-4)
    assert lp.text_offset[0] == 0
    assert all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))


def test_echo_prepends_the_prompt(client, server, offline_llm):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                  temperature=0, echo=True, logprobs=1)
    want = _offline(offline_llm, PROMPT, temperature=0, max_tokens=4)
    assert r.choices[0].text == PROMPT + want.outputs[0].text
    lp = r.choices[0].logprobs
    n_prompt = len(want.prompt_token_ids)
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1] is not None


def test_stop_string_and_stop_token_ids(client, server, offline_llm):
    full = _offline(offline_llm, PROMPT, temperature=0, max_tokens=16, ignore_eos=True).outputs[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                  temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.text == full.text[:full.text.find(stop)]
    tid = full.token_ids[3]
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                  temperature=0,
                                  extra_body={"stop_token_ids": [tid], "ignore_eos": True})
    want = _offline(offline_llm, PROMPT, temperature=0, max_tokens=16, ignore_eos=True,
                    stop_token_ids=[tid]).outputs[0]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want.text
    assert r.usage.completion_tokens == full.token_ids.index(tid) + 1


def test_chat_matches_offline_chat(client, server, offline_llm):
    r = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=10,
                                       temperature=0)
    want = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10))[0]
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.choices[0].finish_reason == want.outputs[0].finish_reason


def test_chat_stream_role_first_then_content_then_usage(client, server, offline_llm):
    stream = client.chat.completions.create(model=server.model, messages=CHAT,
                                            max_completion_tokens=10, temperature=0, n=2,
                                            seed=5, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    texts: dict[int, str] = {}
    seen_role: set[int] = set()
    for ch in chunks[:-1]:
        for c in ch.choices:
            if c.index not in seen_role:
                assert c.delta.role == "assistant", "the role comes first"
                seen_role.add(c.index)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    want = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10, n=2, seed=5))[0]
    assert texts == {o.index: o.text for o in want.outputs}
    assert chunks[-1].usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)


def test_chat_logprobs_and_top_logprobs(client, server, offline_llm):
    r = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    want = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0]
    content = r.choices[0].logprobs.content
    out = want.outputs[0]
    assert len(content) == len(out.token_ids)
    for entry, tid, lps in zip(content, out.token_ids, out.logprobs):
        assert entry.logprob == pytest.approx(lps[tid].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_chat_seed_reproducible(client, server):
    kw = dict(model=server.model, messages=CHAT, max_tokens=8, temperature=1.0, seed=99)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_errors_reach_the_client_typed(client, server):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=2, top_p=2.0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=[1] * 5000, max_tokens=2)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=10**6)
    assert e.value.body["code"] == "context_length_exceeded"


def test_vllm_extras_match_offline(client, server, offline_llm):
    """prompt_logprobs, min_tokens, top_k and min_p through extra_body, as vLLM takes them."""
    ids = offline_llm.get_tokenizer().encode(PROMPT)
    eos = offline_llm.engine.cfg.eos_token_ids
    kw = dict(temperature=0.8, top_k=20, min_p=0.05, seed=3, min_tokens=6, max_tokens=8,
              prompt_logprobs=2, stop_token_ids=sorted(eos))
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8,
                                  temperature=0.8, seed=3, extra_body={
                                      k: kw[k] for k in ("top_k", "min_p", "min_tokens",
                                                         "prompt_logprobs", "stop_token_ids")})
    want = _offline(offline_llm, PROMPT, **kw)
    c = r.choices[0]
    assert c.text == want.outputs[0].text
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids) >= 6
    plps = c.model_extra["prompt_logprobs"]
    assert plps[0] is None and len(plps) == len(ids)
    for got, exp, tid in zip(plps[1:], want.prompt_logprobs[1:], ids[1:]):
        assert got[str(tid)]["logprob"] == pytest.approx(exp[tid].logprob, abs=1e-4)
        assert len(got) >= 2
