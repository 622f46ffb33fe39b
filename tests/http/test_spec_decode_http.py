"""Speculative decoding as a user of the HTTP server sees it.

A second app beside the session's plain ``server``, configured through the real ``epserve serve``
flags with ``--speculative-config`` (n-gram, 3 drafted tokens): its greedy completions, chat
answers and logprobs, streamed or not, equal the plain server's token for token; its /metrics
carries vLLM's four spec-decode counters, consistent with each other, and the plain server's
carries none of them.
"""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest
import requests
from serverkit import (API_KEY, Server, metric, remove_side_app, scrape, side_app,
                       side_app_base, wait_for)

SPEC_APP, SPEC_HEAD, SPEC_PREFIX = ("epserve-http-spec", "epserve-head-spec", "/spec")
K = 3
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
               "prompt_lookup_min": 1}
COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# phrases that repeat, so the n-gram drafter finds matches in the prompt; and plain ones
PROMPTS = ["one two three four one two three four one two three four one two",
           "the cat sat on the mat. the cat sat on the mat. the cat sat on the",
           "Hello, my name is",
           "A B C D E A B C D E A B C D E A B",
           "The experts said"]
TOKEN_PROMPT = [17, 42, 99, 17, 42, 99, 17, 42, 99, 17, 42]
MAX_TOKENS = 40


def _spec_config(getfixture):
    """The demo model as ``epserve serve --dtype float32 --seed 0 --speculative-config ...``
    serves it (the flags parsed by the CLI's own parser)."""
    from epserve.deploy.cli import _parser
    from epserve.deploy.server import config_from_args

    args = _parser().parse_args([
        "serve", "--model", str(getfixture("demo_model_dir")), "--dtype", "float32", "--seed",
        "0", "--served-model-name", "demo-spec", "--api-key", API_KEY,
        "--speculative-config", json.dumps(SPEC_CONFIG)])
    return dataclasses.replace(config_from_args(args), head_name=SPEC_HEAD)


side_app("spec_server", SPEC_APP, SPEC_PREFIX, _spec_config)


@pytest.fixture(scope="module")
def spec_server(server, request) -> Server:
    """The speculative app (``_spec_config``), under /spec beside ``server``."""
    base = side_app_base("spec_server", server, request.getfixturevalue,
                         "the speculative app")
    assert _spec_config(request.getfixturevalue).engine.speculative_config == SPEC_CONFIG
    yield Server(base, "demo-spec", API_KEY)
    remove_side_app("spec_server")


@pytest.fixture(scope="module")
def spec_client(spec_server):
    return openai.OpenAI(base_url=spec_server.v1, api_key=spec_server.api_key, max_retries=0,
                         timeout=120)


def _completions(cl, model: str, prompt, stream: bool = False, ignore_eos: bool = False):
    return cl.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                 temperature=0, logprobs=2, stream=stream, extra_body={
                                     "return_token_ids": True, "ignore_eos": ignore_eos})


def _choices(r) -> list[tuple]:
    """Per choice: text, token ids, finish reason, logprob tokens, chosen and top logprobs."""
    return [(c.text, c.token_ids, c.finish_reason, c.logprobs.tokens, c.logprobs.token_logprobs,
             c.logprobs.top_logprobs) for c in sorted(r.choices, key=lambda c: c.index)]


def _same(got: list[tuple], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[:4] == w[:4]  # text, token ids, finish reason, token strings: exactly
        assert g[4] == pytest.approx(w[4], abs=1e-4)  # logprobs: up to float noise
        assert [sorted(t) for t in g[5]] == [sorted(t) for t in w[5]]
        for gt, wt in zip(g[5], w[5]):
            assert gt == pytest.approx(wt, abs=1e-4)


def test_greedy_completions_equal_the_plain_server(client, server, spec_client, spec_server):
    for prompt in [*PROMPTS, TOKEN_PROMPT]:
        want = _choices(_completions(client, server.model, prompt))
        got = _choices(_completions(spec_client, spec_server.model, prompt))
        _same(got, want)
        assert len(got[0][1]) > 0
    # all prompts in one request: their rows verify drafts in the same steps
    want = _choices(_completions(client, server.model, PROMPTS))
    _same(_choices(_completions(spec_client, spec_server.model, PROMPTS)), want)
    # run to max_tokens whatever the model says, so every answer has all its tokens to compare
    want = _choices(_completions(client, server.model, PROMPTS[:2], ignore_eos=True))
    got = _choices(_completions(spec_client, spec_server.model, PROMPTS[:2], ignore_eos=True))
    _same(got, want)
    assert all(len(g[1]) == MAX_TOKENS and g[2] == "length" for g in got)


def _streamed(stream) -> list[tuple]:
    """Per choice index: concatenated text and token ids, finish reason, logprob tokens."""
    acc: dict[int, list] = {}
    for chunk in stream:
        for c in chunk.choices:
            a = acc.setdefault(c.index, ["", [], None, [], []])
            a[0] += c.text
            a[1] += c.token_ids or []
            if c.finish_reason is not None:
                assert a[2] is None, "a choice finished twice"
                a[2] = c.finish_reason
            if c.logprobs is not None:
                a[3] += c.logprobs.tokens
                a[4] += c.logprobs.token_logprobs
    return [tuple(acc[i]) for i in sorted(acc)]


def test_streamed_completions_equal_the_plain_server(client, server, spec_client, spec_server):
    for prompt in (PROMPTS[0], PROMPTS[3], TOKEN_PROMPT, PROMPTS[:3]):
        want = _streamed(_completions(client, server.model, prompt, stream=True))
        got = _streamed(_completions(spec_client, spec_server.model, prompt, stream=True))
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert g[:4] == w[:4]
            assert g[4] == pytest.approx(w[4], abs=1e-4)
        # and the stream says what the whole answer says
        whole = _choices(_completions(spec_client, spec_server.model, prompt))
        assert [g[:3] for g in got] == [w[:3] for w in whole]


def _chat(cl, model: str, stream: bool):
    msgs = [{"role": "user", "content": "Say 'la la la' over and over: la la la la la la"}]
    return cl.chat.completions.create(model=model, messages=msgs, max_tokens=MAX_TOKENS,
                                      temperature=0, logprobs=True, top_logprobs=2,
                                      stream=stream)


def test_chat_equals_the_plain_server_streamed_or_not(client, server, spec_client, spec_server):
    want = _chat(client, server.model, False).choices[0]
    got = _chat(spec_client, spec_server.model, False).choices[0]
    assert got.message.content == want.message.content
    assert got.finish_reason == want.finish_reason
    assert [e.token for e in got.logprobs.content] == [e.token for e in want.logprobs.content]
    assert [e.logprob for e in got.logprobs.content] == pytest.approx(
        [e.logprob for e in want.logprobs.content], abs=1e-4)
    text, tokens = "", []
    for chunk in _chat(spec_client, spec_server.model, True):
        for c in chunk.choices:
            text += c.delta.content or ""
            tokens += [e.token for e in (c.logprobs.content if c.logprobs else None) or []]
    assert text == want.message.content
    assert tokens == [e.token for e in want.logprobs.content]


def _spec_samples(samples: dict[str, float]) -> tuple[list[float], list[float]]:
    counters = [metric(samples, name, model_name="demo-spec") for name in COUNTERS]
    per_pos = [metric(samples, PER_POS, model_name="demo-spec", position=str(p))
               for p in range(K)]
    return counters, per_pos


def test_metrics_count_drafts_and_acceptances(spec_server, spec_client):
    before = scrape(spec_server)
    (drafts0, drafted0, accepted0), per0 = _spec_samples(before)
    gen0 = metric(before, "vllm:generation_tokens_total")
    r = _completions(spec_client, spec_server.model, PROMPTS, ignore_eos=True)
    produced = sum(len(c.token_ids) for c in r.choices)
    assert produced == MAX_TOKENS * len(PROMPTS)

    def settled():
        s = scrape(spec_server)
        return s if metric(s, "vllm:generation_tokens_total") - gen0 >= produced else None

    after = wait_for(settled)
    assert after is not None, "/metrics never counted the generated tokens"
    # accepted drafts are generated tokens once, not twice
    assert metric(after, "vllm:generation_tokens_total") - gen0 == produced
    (drafts, drafted, accepted), per_pos = _spec_samples(after)
    d_drafts, d_drafted, d_accepted = drafts - drafts0, drafted - drafted0, accepted - accepted0
    d_per = [a - b for a, b in zip(per_pos, per0)]
    assert d_drafts > 0 and d_drafted > 0, "repeated phrases drew no n-gram drafts"
    assert d_drafts <= d_drafted <= K * d_drafts  # 1..K drafted tokens per verify row
    assert 0 <= d_accepted <= d_drafted
    assert accepted <= drafted
    # a verify step keeps its accepted drafts and then one token of the model's own
    assert d_accepted + d_drafts <= produced
    assert sum(d_per) == d_accepted and sum(per_pos) == accepted
    assert all(per_pos[p] >= per_pos[p + 1] for p in range(K - 1)), per_pos
    assert all(d_per[p] >= d_per[p + 1] for p in range(K - 1)), d_per
    assert per_pos[0] <= drafts
    # the exposition itself: counters, one per-position sample per draft position, no more
    text = requests.get(f"{spec_server.base}/metrics", headers=spec_server.auth,
                        timeout=30).text
    for name in (*COUNTERS, PER_POS):
        assert f"# TYPE {name} counter" in text, name
    lines = [ln for ln in text.splitlines() if ln.startswith(PER_POS + "{")]
    assert sorted(lines) == sorted(
        f'{PER_POS}{{engine="0",model_name="demo-spec",position="{p}"}} {per_pos[p]}'
        for p in range(K))  # vLLM V1's labels: the model, the engine, the position


def test_a_server_without_speculation_exports_no_spec_decode_metrics(client, server):
    client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=8,
                              temperature=0)
    text = requests.get(f"{server.base}/metrics", headers=server.auth, timeout=30).text
    assert "vllm:generation_tokens_total" in text
    assert "spec_decode" not in text
