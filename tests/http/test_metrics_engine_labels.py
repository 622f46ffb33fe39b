"""/metrics as a vLLM V1 dashboard scrapes it: every vLLM series carries ``model_name`` and
``engine`` (``engine="0"``, one engine per app; ``vllm:cache_config_info`` the engine and the
cache config, as vLLM's); the
time per output token (per gap, and vLLM V1's per request) moves with a stream; and
``vllm:num_preemptions_total`` counts the preemptions of an engine whose KV pool is too small
for what it was sent (a second app beside the shared one, as ``epserve serve --num-kv-blocks
12 --block-size 4`` would serve)."""

from __future__ import annotations

import asyncio
import re

import pytest
import requests
from serverkit import (API_KEY, Server, metric, remove_side_app, scrape, side_app,
                       side_app_base, wait_for)

SMALL_APP, SMALL_HEAD, SMALL_PREFIX = ("epserve-http-small-kv", "epserve-head-small-kv",
                                       "/smallkv")
_SERIES = re.compile(r'^(vllm:[\w:]+)(\{[^}]*\})?\s', re.M)


def _labels(text: str) -> dict[str, set[str]]:
    """Each vllm series name with the label names it carries (bucket labels left out)."""
    out: dict[str, set[str]] = {}
    for name, labels in _SERIES.findall(text):
        keys = set(re.findall(r'(\w+)="', labels or "")) - {"le"}
        out.setdefault(name, set()).update(keys)
    return out


def test_every_vllm_series_has_model_name_and_engine(server, client):
    client.completions.create(model=server.model, prompt="Hi", max_tokens=2)
    text = requests.get(f"{server.base}/metrics", headers=server.auth, timeout=30).text
    series = _labels(text)
    assert len(series) >= 20, sorted(series)
    for name, keys in series.items():  # cache_config_info: the cache config and the engine
        want = {"engine"} if name == "vllm:cache_config_info" else {"model_name", "engine"}
        assert want <= keys, (name, keys)
    assert 'vllm:num_requests_running{engine="0",model_name="demo"}' in text
    samples = scrape(server)
    assert metric(samples, "vllm:cache_config_info", engine="0", block_size="16") == 1.0
    assert metric(samples, "vllm:request_success_total", engine="0", model_name="demo",
                  finished_reason="length") >= 1


def test_time_per_output_token_moves_with_a_stream(server, client):
    names = ("vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds")
    before = scrape(server)
    stream = client.completions.create(model=server.model, prompt="The experts said",
                                       max_tokens=6, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert sum(1 for _ in stream) >= 1

    def moved():
        after = scrape(server)
        d = {n: metric(after, n + "_count", engine="0") - metric(before, n + "_count",
                                                                 engine="0") for n in names}
        return (after, d) if d[names[1]] >= 1 else None

    got = wait_for(moved)
    assert got is not None, "the per-request TPOT was never observed"
    after, d = got
    # one gap per output that brought tokens after the first: 1 to 5 for 6 tokens
    assert 1 <= d[names[0]] <= 5 and d[names[1]] == 1
    for n in names:
        total = metric(after, n + "_sum") - metric(before, n + "_sum")
        assert 0 < total < 60, (n, total)
        assert metric(after, n + "_bucket", le="+Inf", engine="0") == \
            metric(after, n + "_count", engine="0")


def _small_kv_config(getfixture) -> dict:
    return {"model": str(getfixture("demo_model_dir")), "dtype": "float32", "seed": 0,
            "served_model_name": "small-kv", "api_key": API_KEY, "head_name": SMALL_HEAD,
            "num_kv_blocks": 12, "block_size": 4, "enable_prefix_caching": False}


side_app("small_kv_server", SMALL_APP, SMALL_PREFIX, _small_kv_config)


@pytest.fixture(scope="module")
def small_kv_server(server, request) -> Server:
    base = side_app_base("small_kv_server", server, request.getfixturevalue,
                         "the small-KV app")
    yield Server(base, "small-kv", API_KEY)
    remove_side_app("small_kv_server")  # this module's engine goes with it


def test_num_preemptions_counts_what_a_small_kv_pool_forces(small_kv_server):
    import openai

    srv = small_kv_server
    before = metric(scrape(srv), "vllm:num_preemptions_total", engine="0",
                    model_name="small-kv")
    prompts = [f"Request {i}: the experts of the mixture said" for i in range(6)]

    async def run_all():  # 6 rows of ~14 + 24 tokens want ~60 blocks of 4; there are 12
        async with openai.AsyncOpenAI(base_url=srv.v1, api_key=srv.api_key, max_retries=0,
                                      timeout=180) as c:
            return await asyncio.gather(*(c.completions.create(
                model=srv.model, prompt=p, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True}) for p in prompts))

    outs = asyncio.run(run_all())
    assert all(o.usage.completion_tokens == 24 for o in outs)  # each finished, preempted or not
    samples = scrape(srv)
    preempted = metric(samples, "vllm:num_preemptions_total", engine="0",
                       model_name="small-kv") - before
    assert preempted >= 1, "12 blocks of 4 held 6 rows of 38 tokens without a preemption?"


def test_request_parameter_histograms(server, client):
    """vLLM's vllm:request_params_n (once per request), vllm:request_params_max_tokens (once
    per choice; the context left after the prompt when the request set none) and
    vllm:request_max_num_generation_tokens (the longest choice, once per request)."""
    names = ("vllm:request_params_n", "vllm:request_params_max_tokens",
             "vllm:request_max_num_generation_tokens")

    def totals(samples):
        return {n: (metric(samples, n + "_count", engine="0"),
                    metric(samples, n + "_sum", engine="0")) for n in names}

    before = totals(scrape(server))
    client.completions.create(model=server.model, prompt="The experts said", n=2,
                              max_tokens=5, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(  # no max_tokens: the choice ends it at once
        model=server.model, messages=[{"role": "user", "content": "Hi"}],
        extra_body={"structured_outputs": {"choice": ["ok"]}})
    left = client.models.list().data[0].model_extra["max_model_len"] - chat.usage.prompt_tokens

    def moved():
        now = totals(scrape(server))
        d = {n: (now[n][0] - before[n][0], now[n][1] - before[n][1]) for n in names}
        return d if d[names[0]][0] >= 2 else None

    d = wait_for(moved)
    assert d is not None, "the parameter histograms never moved"
    assert d["vllm:request_params_n"] == (2, 3)  # n=2, then n=1
    assert d["vllm:request_params_max_tokens"] == (3, 2 * 5 + left)
    assert d["vllm:request_max_num_generation_tokens"] == (2, 5 + chat.usage.completion_tokens)
