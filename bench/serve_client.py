"""The HTTP client of bench/serve.py: one aiohttp session, requests at a concurrency or a
Poisson rate, SSE parsed by hand, a timing record per request, and the run's summary.

A streamed request asks for ``stream_options.include_usage`` and ``return_token_ids`` (epserve's
and vLLM's extension: each chunk's choice carries its new ``token_ids``), so the tokens a chunk
carries are counted exactly; a server without it falls back to one token per chunk with text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from typing import Any

import aiohttp


@dataclasses.dataclass
class Req:
    """One request of the workload: token ids or text (completions), or a text (chat)."""

    prompt: list[int] | str
    max_tokens: int


@dataclasses.dataclass
class Record:
    """What one request measured (times in seconds from its send)."""

    expected: int
    error: str | None = None
    ttft: float | None = None
    e2e: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    tokens: int = 0             # counted from the chunks' token_ids (or the body's)
    usage_tokens: int | None = None
    prompt_tokens: int = 0
    ids_seen: bool = False      # token_ids came back (exact counts)

    @property
    def mismatch(self) -> bool:
        return self.error is None and (self.tokens != self.expected or (
            self.usage_tokens is not None and self.usage_tokens != self.expected))


def payload(endpoint: str, model: str, req: Req, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": stream, "return_token_ids": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _choice_tokens(choice: dict[str, Any], rec: Record) -> int:
    """Tokens one choice carries: its token_ids when sent, else 1 if it carries text."""
    ids = choice.get("token_ids")
    if ids is not None:
        rec.ids_seen = True
        return len(ids)
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return 1 if text else 0


def _event(data: str, rec: Record, t: float) -> bool:
    """Take one SSE ``data:`` payload; False at ``[DONE]``."""
    if data == "[DONE]":
        return False
    obj = json.loads(data)
    if "error" in obj and not obj.get("choices"):
        err = obj["error"]
        rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
        return True
    usage = obj.get("usage")
    if usage:
        rec.usage_tokens = usage.get("completion_tokens")
        rec.prompt_tokens = usage.get("prompt_tokens") or rec.prompt_tokens
    n = sum(_choice_tokens(c, rec) for c in obj.get("choices") or [])
    if n:
        if rec.ttft is None:
            rec.ttft = t
        rec.chunk_times.append(t)
        rec.chunk_tokens.append(n)
        rec.tokens += n
    return True


async def _read_stream(resp: aiohttp.ClientResponse, rec: Record, t0: float) -> None:
    """SSE by hand: events end with a blank line; every ``data:`` line is one payload, stamped
    with the arrival time of the bytes that completed it."""
    buf = b""
    async for piece in resp.content.iter_any():
        t = time.perf_counter() - t0
        buf = (buf + piece).replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.decode("utf-8").splitlines():
                if line.startswith("data:") and not _event(line[5:].strip(), rec, t):
                    return
    if rec.error is None:
        rec.error = "stream ended without [DONE]"


def _read_body(obj: dict[str, Any], rec: Record) -> None:
    usage = obj.get("usage") or {}
    rec.usage_tokens = usage.get("completion_tokens")
    rec.prompt_tokens = usage.get("prompt_tokens") or 0
    rec.tokens = sum(_choice_tokens(c, rec) for c in obj.get("choices") or [])
    if not rec.ids_seen:  # no token_ids: trust the usage
        rec.tokens = rec.usage_tokens or 0


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               expected: int) -> Record:
    rec = Record(expected=expected)
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            elif body["stream"]:
                await _read_stream(resp, rec, t0)
            else:
                _read_body(await resp.json(), rec)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    rec.e2e = time.perf_counter() - t0
    return rec


async def run_load(base: str, api_key: str | None, model: str, endpoint: str,
                   reqs: list[Req], stream: bool, concurrency: int | None, rate: float,
                   seed: int = 0) -> tuple[list[Record], float]:
    """Send ``reqs`` with at most ``concurrency`` in flight (None: no cap), arriving as a
    Poisson process of ``rate``/s (inf: all at once). Returns the records and the wall time
    from the first send to the last answer."""
    url = f"{base}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = concurrency or len(reqs)
    conn = aiohttp.TCPConnector(limit=limit + 8, limit_per_host=0, keepalive_timeout=300)
    timeout = aiohttp.ClientTimeout(total=6 * 3600, sock_connect=120)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(seed)

    async def one(req: Req) -> Record:
        async with sem:
            return await send(session, url, payload(endpoint, model, req, stream),
                              req.max_tokens)

    async with aiohttp.ClientSession(connector=conn, timeout=timeout, headers=headers) as session:
        tasks = []
        t0 = time.perf_counter()
        for i, req in enumerate(reqs):
            if i and math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
            tasks.append(asyncio.ensure_future(one(req)))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, numpy's default); None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(xs: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of ``xs`` (seconds) in milliseconds."""
    ms = [1e3 * x for x in xs]
    return {"mean": sum(ms) / len(ms) if ms else None, "p50": pct(ms, 50), "p90": pct(ms, 90),
            "p99": pct(ms, 99)}


def summarize(records: list[Record], wall: float) -> dict[str, Any]:
    """The run's figures: throughput over ``wall``, latency stats over the good requests."""
    ok = [r for r in records if r.error is None]
    out = sum(r.tokens for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    gaps = [[b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])] for r in ok]
    q1 = [g for gs in gaps for g in gs[:len(gs) // 4]]
    q4 = [g for gs in gaps for g in gs[len(gs) - len(gs) // 4:]]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    return {
        "n": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "mismatches": sum(r.mismatch for r in records), "wall_s": wall,
        "req_s": len(ok) / wall, "out_tok_s": out / wall,
        "total_tok_s": (out + sum(r.prompt_tokens for r in ok)) / wall,
        "out_tokens": out, "chunks": chunks, "chunks_s": chunks / wall if chunks else None,
        "tok_per_chunk": out / chunks if chunks else None,
        "exact_counts": all(r.ids_seen for r in ok),
        "ttft": stats([r.ttft for r in ok if r.ttft is not None]), "tpot": stats(tpot),
        "itl": stats(itl), "itl_q1": stats(q1)["mean"], "itl_q4": stats(q4)["mean"],
        "e2e": stats([r.e2e for r in ok]),
        "first_errors": sorted({r.error for r in records if r.error})[:3],
        "token_counts": sorted({(r.tokens, r.usage_tokens) for r in records if r.mismatch})[:5],
    }
