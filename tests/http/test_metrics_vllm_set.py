"""/metrics carries the rest of vLLM's set: inter-token latency, prompt and generation token
histograms, prefix-cache queries and hits, the engine's queue/prefill/decode/inference time and
tokens-per-step histograms, cache_config_info, and no ``*_created`` series."""

from __future__ import annotations

import requests
from serverkit import metric, scrape, wait_for

LONG = [(13 * i) % 300 + 9 for i in range(70)]  # four full 16-token blocks and more


def test_the_rest_of_vllms_metrics_move_as_requests_do(server, client):
    before = scrape(server)
    client.completions.create(model=server.model, prompt=LONG, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    client.completions.create(model=server.model, prompt=LONG, max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})  # a prefix-cache hit

    def moved():
        after = scrape(server)
        d = {k: metric(after, k) - metric(before, k) for k in (
            "vllm:request_prompt_tokens_count", "vllm:request_prompt_tokens_sum",
            "vllm:request_generation_tokens_sum", "vllm:inter_token_latency_seconds_count",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
        return (after, d) if d["vllm:request_prompt_tokens_count"] >= 2 else None

    got = wait_for(moved)
    assert got is not None, "the histograms did not move"
    after, d = got
    assert d["vllm:request_prompt_tokens_sum"] == 2 * len(LONG)
    assert d["vllm:request_generation_tokens_sum"] == 10
    # one gap per output that brought tokens after the first: at most 4 per 5-token request
    # (fewer when several tokens arrive together, as under load)
    assert 0 < d["vllm:inter_token_latency_seconds_count"] <= 8
    assert d["vllm:prefix_cache_queries_total"] == 2 * len(LONG)
    assert d["vllm:prefix_cache_hits_total"] >= 64
    assert metric(after, "vllm:cache_config_info", block_size="16") == 1.0
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
        assert metric(after, name + "_count") - metric(before, name + "_count") >= 2, name
        assert metric(after, name + "_bucket", le="+Inf") == metric(after, name + "_count")
    steps = metric(after, "vllm:iteration_tokens_total_count") - \
        metric(before, "vllm:iteration_tokens_total_count")
    tokens = metric(after, "vllm:iteration_tokens_total_sum") - \
        metric(before, "vllm:iteration_tokens_total_sum")
    assert steps >= 8 and tokens >= 2 * len(LONG) - 64 + 8  # prefill (less the hit) + decode
    text = requests.get(f"{server.base}/metrics", headers=server.auth, timeout=30).text
    assert "_created" not in text
