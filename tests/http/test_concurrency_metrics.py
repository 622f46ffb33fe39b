"""64 concurrent streaming clients: every stream completes with exactly the offline API's
text and token count, and /metrics moves by exactly what they did."""

from __future__ import annotations

import asyncio

from serverkit import metric, scrape, wait_for

from epserve import SamplingParams

N_CLIENTS = 64
MAX_TOKENS = 12


async def _one(client, model: str, prompt: str) -> tuple[str, int, int, list[str], int]:
    """(text, completion tokens, prompt tokens, finish reasons, logprob tokens) of a stream."""
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        logprobs=0, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, reasons, usage, lp_tokens = "", [], None, 0
    async for ch in stream:
        for c in ch.choices:
            text += c.text
            lp_tokens += len(c.logprobs.tokens) if c.logprobs else 0
            if c.finish_reason:
                reasons.append(c.finish_reason)
        if ch.usage is not None:
            usage = ch.usage
    return text, usage.completion_tokens, usage.prompt_tokens, reasons, lp_tokens


def test_64_concurrent_streams_match_offline_and_metrics(server, offline_llm):
    import openai

    prompts = [f"Request {i}: the experts said" for i in range(N_CLIENTS)]
    want = offline_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True))
    before = scrape(server)

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key=server.api_key,
                                      max_retries=0, timeout=180) as client:
            return await asyncio.gather(*(_one(client, server.model, p) for p in prompts))

    results = asyncio.run(run_all())
    for (text, n_gen, n_prompt, reasons, lp_tokens), w in zip(results, want):
        assert text == w.outputs[0].text
        assert n_gen == len(w.outputs[0].token_ids) == MAX_TOKENS
        assert lp_tokens == MAX_TOKENS, "every token's logprob arrives once"
        assert n_prompt == len(w.prompt_token_ids)
        assert reasons == ["length"]

    after = wait_for(lambda: (lambda s: s if metric(s, "vllm:num_requests_running") == 0
                              else None)(scrape(server)))
    assert after is not None, "requests still running after every stream ended"
    d = {name: metric(after, name, **labels) - metric(before, name, **labels)
         for name, labels in [("vllm:prompt_tokens_total", {}),
                              ("vllm:generation_tokens_total", {}),
                              ("vllm:e2e_request_latency_seconds_count", {}),
                              ("vllm:time_to_first_token_seconds_count", {})]}
    assert d["vllm:prompt_tokens_total"] == sum(len(w.prompt_token_ids) for w in want)
    assert d["vllm:generation_tokens_total"] == N_CLIENTS * MAX_TOKENS
    assert d["vllm:e2e_request_latency_seconds_count"] == N_CLIENTS
    assert d["vllm:time_to_first_token_seconds_count"] == N_CLIENTS
    ok = (metric(after, "vllm:request_success_total", finished_reason="length")
          - metric(before, "vllm:request_success_total", finished_reason="length"))
    assert ok == N_CLIENTS
    assert metric(after, "vllm:num_requests_waiting") == 0
    assert 'model_name="demo"' in next(k for k in after if k.startswith("vllm:kv_cache_usage"))
