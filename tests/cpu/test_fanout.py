"""Fanout (the ingress's merge of one request's prompts): every engine stream is read to its
end, even when its output object, which grows in place, already says finished by the time
the first outputs are handed on; the end of a stream is where the request's latency is timed
(/metrics e2e count), so a stream left unread is a request /metrics never counts."""

from __future__ import annotations

import asyncio

import pytest

from epserve.deploy.stream import Fanout
from epserve.head.outputs import CompletionOutput, RequestOutput


def _stream(out: RequestOutput, ended: list[str]):
    """EngineClient.stream's contract: the same output object each time, changed in place by
    later records; after the finished one the stream ends (and times the request)."""

    async def gen():
        while True:
            yield out
            if out.finished:
                ended.append(out.request_id)
                return
            out.finished = True  # what the next record does
            out.outputs[0].finish_reason = "length"

    return gen()


async def _run(n: int, finish_early: bool, final: bool) -> tuple[list[str], list]:
    ended: list[str] = []
    outs = [RequestOutput(request_id=f"r{i}", prompt=None, prompt_token_ids=[1],
                          outputs=[CompletionOutput(index=0, token_ids=[5])]) for i in range(n)]
    streams = [_stream(o, ended) for o in outs]
    firsts = [await s.__anext__() for s in streams]
    if finish_early:  # the poller applied the last record before the consumer read the first
        for o in outs:
            o.finished = True
            o.outputs[0].finish_reason = "length"
    fan = Fanout(streams, firsts)
    try:
        got = await fan.final() if final else [o async for _, o in fan.outputs()]
    finally:
        await fan.close()
    return sorted(ended), got


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("finish_early", [False, True])
@pytest.mark.parametrize("final", [False, True])
def test_every_stream_is_read_to_its_end(n, finish_early, final):
    ended, got = asyncio.run(_run(n, finish_early, final))
    assert ended == [f"r{i}" for i in range(n)]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in got)
