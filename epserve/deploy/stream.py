"""Fan-out of one HTTP request over its prompts, and cumulative outputs turned into deltas.

Invariants: ``open_streams`` returns only once every prompt's first output is in (so an
engine refusal is still an HTTP 4xx, before any byte of a 200 is sent), and on any failure
closes every stream it opened (each close aborts its request); ``Fanout.close`` does the same
for a running fan-out. ``DeltaTracker`` never repeats or drops a token or a character: each
delta is exactly what a choice gained since the last one, and its finish reason comes once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from epserve.deploy.engine_client import EngineClient
from epserve.deploy.metrics import ServerMetrics
from epserve.head.outputs import LogprobsDict, RequestOutput


@dataclass(frozen=True)
class Prompt:
    """One prompt ready for the engine: its text (None for token ids) and token ids."""

    text: str | None
    ids: list[int]


class Fanout:
    """One engine request per prompt; their outputs merged in arrival order."""

    def __init__(self, streams: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput]):
        self._streams = streams
        self.firsts = firsts
        self._tasks: list[asyncio.Task] = []

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output), first outputs first, until all are finished."""
        for i, out in enumerate(self.firsts):
            yield i, out
        # Every stream is read to its end, even one whose first output now says finished: the
        # output object grows in place, so "finished" may have arrived after the first was
        # taken, and only the stream's own next step times the request's end (e2e metrics).
        if len(self._streams) == 1:  # one prompt (most requests): no task and queue
            async for out in self._streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, queue))
                       for i in range(len(self._streams))]
        remaining = len(self._tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    async def _pump(self, i: int, queue: asyncio.Queue) -> None:
        try:
            async for out in self._streams[i]:
                queue.put_nowait((i, out))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    async def final(self) -> list[RequestOutput]:
        """The finished output of every prompt, in prompt order."""
        last = list(self.firsts)
        async for i, out in self.outputs():
            last[i] = out
        return last

    async def close(self) -> None:
        """Stop everything still running; each unfinished request is aborted."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self._streams:
            with contextlib.suppress(Exception):
                await s.aclose()


async def open_streams(client: EngineClient, request_id: str, prompts: Sequence[Prompt],
                       params: dict[str, Any], param: str, metrics: ServerMetrics | None = None,
                       arrival: float | None = None) -> Fanout:
    """Start every prompt's request and wait for each first output (errors raise here);
    ``metrics`` times each request from ``arrival`` (time.monotonic())."""
    streams = [client.stream(f"{request_id}-{i}", p.ids, params, p.text, param=param,
                             timer=metrics.timer(arrival, params) if metrics is not None
                             else None)
               for i, p in enumerate(prompts)]
    tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
    try:
        firsts = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()
        raise
    return Fanout(streams, list(firsts))


@dataclass(frozen=True)
class Delta:
    """What one choice gained since the last delta. ``logprobs``: one dict per new token
    (None when not requested); ``finish_reason`` is set on a choice's last delta only."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool


class DeltaTracker:
    """Per-choice progress of a fan-out; choice index = prompt index * n + completion index."""

    def __init__(self, num_prompts: int, n: int):
        self.n = n
        total = num_prompts * n
        self.text_len = [0] * total
        self.num_tokens = [0] * total
        self.sent_any = [False] * total
        self.finished = [False] * total
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts

    @property
    def completion_tokens(self) -> int:
        return sum(self.num_tokens)

    def update(self, prompt_index: int, out: RequestOutput, want_logprobs: bool,
               want_ids: bool = False) -> list[Delta]:
        """The deltas of ``out`` (cumulative), in completion order; choices that gained
        nothing are left out (a choice with new tokens but no new text is kept when logprobs
        or token ids are wanted, so every token is sent as soon as it exists)."""
        self.prompt_tokens[prompt_index] = len(out.prompt_token_ids)
        self.cached_tokens[prompt_index] = out.num_cached_tokens
        deltas = []
        for c in out.outputs:
            k = prompt_index * self.n + c.index
            if self.finished[k]:
                continue
            text = c.text[self.text_len[k]:] if len(c.text) > self.text_len[k] else ""
            ids = c.token_ids[self.num_tokens[k]:]
            lps = c.logprobs[self.num_tokens[k]:] if want_logprobs and c.logprobs else None
            reason = c.finish_reason if c.finish_reason in ("stop", "length") else None
            if not (text or reason or ((want_logprobs or want_ids) and ids)):
                continue
            deltas.append(Delta(k, text, list(ids), lps, reason,
                                c.stop_reason if reason else None, not self.sent_any[k]))
            self.text_len[k] += len(text)
            self.num_tokens[k] += len(ids)
            self.sent_any[k] = True
            self.finished[k] = reason is not None
        return deltas


async def chat_chunks(sse: AsyncIterator[str]) -> AsyncIterator[dict]:
    """A chat completion's SSE stream (``data:`` lines, then ``[DONE]``) read back as chunk
    dicts, for the APIs shaped over it (``/v1/messages``, ``/v1/responses``); the stream is
    closed when the reader stops."""
    async with contextlib.aclosing(sse):  # type: ignore[type-var]
        async for line in sse:
            data = line.removeprefix("data: ").strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
