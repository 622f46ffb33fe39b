"""Under load the server loses nothing: 32 concurrent streams and 32 concurrent non-streaming
requests of the same prompts give the same tokens and text, which are the offline engine's,
while the server coalesces several tokens into one chunk when a stream falls behind."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from epserve import SamplingParams

N, MAX_TOKENS = 32, 24


def _prompts() -> list[list[int]]:
    return [[(11 * i + j) % 900 + 5 for j in range(4 + i % 9)] for i in range(N)]


async def _one(session, server, prompt: list[int], stream: bool) -> tuple[list[int], str, int]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": stream}
    async with session.post(f"{server.v1}/completions", json=body,
                            headers=server.auth) as r:
        assert r.status == 200, await r.text()
        if not stream:
            choice = (await r.json())["choices"][0]
            return choice["token_ids"], choice["text"], 1
        ids, text, chunks = [], "", 0
        async for line in r.content:
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                ids += choice["token_ids"]
                text += choice["text"]
                chunks += 1
        return ids, text, chunks


async def _all(server, stream: bool):
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(_one(session, server, p, stream) for p in _prompts()))


def test_streams_and_non_streams_agree_under_load(server, offline_llm):
    streamed = asyncio.run(_all(server, True))
    whole = asyncio.run(_all(server, False))
    want = offline_llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True))
    for (s_ids, s_text, chunks), (w_ids, w_text, _), ref in zip(streamed, whole, want):
        assert s_ids == w_ids == ref.outputs[0].token_ids
        assert s_text == w_text == ref.outputs[0].text
        assert 1 <= chunks <= MAX_TOKENS
