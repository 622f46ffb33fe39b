"""AsyncEngine: drives an Engine on its own thread and delivers outputs to asyncio callers.

Two kinds of listener: a client ``Outbox`` (an ingress replica, a remote ``LLM``) gets every
one of its requests' news as delta records (``head.output_stream``), all of a step's records
in one hand-over; an in-process ``generate`` stream gets cumulative ``RequestOutput``s.

Invariants: only the engine thread touches the Engine (submissions and aborts are queued in an
inbox it drains before each step), so no caller ever waits on a lock the engine thread holds
during a step: an event loop that submits, aborts, polls or reads ``snapshot`` never blocks,
even while a step is stuck in a collective. Each step costs one wake-up per event loop, however
many requests and tokens it produced. Every request's stream ends (finished output, or an error
that keeps the tokens it had) — a caller never waits forever; a caller that stops listening
aborts its request, so its KV is freed. When the model breaks (a rank died), the engine can be
replaced: ``suspend`` parks the loop, ``resume`` hands every unfinished and queued request to
the new engine, which prefills them again and goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from epserve.head.engine import Engine
from epserve.head.loop_log import LoopLog
from epserve.head.output_builder import build_output
from epserve.head.output_stream import Record, delta_record
from epserve.head.outputs import CompletionOutput, RequestOutput
from epserve.head.sampling_params import SamplingParams
from epserve.head.sequence import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """What /metrics and /health read: published by the engine thread after every step."""

    healthy: bool
    reason: str | None
    num_running: int
    num_waiting: int
    kv_usage: float
    prompt_tokens: int
    generation_tokens: int
    num_preemptions: int
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    histograms: dict = field(default_factory=dict)  # name -> (buckets, counts, sum)
    # None without a speculative_config; else SpecStats's counters, accepted_per_pos one count
    # per draft position 0..k-1 (vLLM exports these only when speculation is configured)
    spec_decode: dict | None = None


class EngineDead(RuntimeError):
    """The engine loop has stopped (a failure, or shutdown); no request can be served."""


class Outbox:
    """One client's delta records, waiting for its next ``take`` (lives on one event loop)."""

    def __init__(self, client_id: str):
        self.client_id = client_id
        self.loop = asyncio.get_running_loop()
        self.records: list[Record] = []
        self.ready = asyncio.Event()
        self.requests: set[str] = set()
        self.last_seen = time.monotonic()

    def put(self, records: list[Record]) -> None:  # on self.loop
        self.records.extend(records)
        self.ready.set()

    async def take(self, wait_s: float) -> list[Record]:
        """Every record so far, waiting up to ``wait_s`` for the first."""
        self.last_seen = time.monotonic()
        if not self.records:
            try:
                await asyncio.wait_for(self.ready.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        out, self.records = self.records, []
        self.ready.clear()
        self.last_seen = time.monotonic()
        for rec in out:
            if rec[1]:  # finished: the client will not hear of it again
                self.requests.discard(rec[0])
        return out


class _Stream:
    """An in-process listener of one request: cumulative outputs on an asyncio queue."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, outs: list[RequestOutput]) -> None:  # on self.loop
        for out in outs:
            self.queue.put_nowait(out)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None


class AsyncEngine:
    """Thread-backed engine loop with client outboxes and per-request streams."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05, recoverable: bool = False,
                 log_every_s: float = 5.0):
        """``recoverable``: the owner replaces a broken engine (``resume``) or gives up
        (``mark_dead``); otherwise a failed step ends every request at once. ``log_every_s``:
        how often a stepping loop logs where its time goes."""
        self.engine = engine
        self._recoverable = recoverable
        self._inbox: deque[_Add | str] = deque()  # submissions, and request ids to abort
        self._wake = threading.Event()
        self._sinks: dict[str, Outbox | _Stream] = {}
        self._dead: str | None = None
        self._suspended: str | None = None
        self._stop, self._idle_wait_s = False, idle_wait_s
        self._parked = threading.Event()  # set while the loop is outside any step, suspended
        self.failure: str | None = None  # why the last step broke the engine, if it did
        self.step_started_at: float | None = None
        self.steps = 0
        self._log = LoopLog(log_every_s)
        self._snapshot = engine_snapshot(engine, None, 0)
        self._watch_arrivals(engine)
        self._thread = self._start_thread()

    def _watch_arrivals(self, engine: Engine) -> None:
        """Tell the model's decode lookahead (one rank) when a submission or an abort waits in
        the inbox: the next step takes new rows, a forward queued ahead would be dropped."""
        ahead = getattr(engine.model, "lookahead", None)
        if ahead is not None:
            ahead.arrivals = self._inbox.__len__

    def _start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self._loop, name="epserve-engine", daemon=True)
        t.start()
        return t

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self._stop:
            if self._suspended is not None:
                self._parked.set()
                self._idle()
                continue
            self._parked.clear()
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._publish()
                if self._guarded(self.engine.keep_alive) is _BROKEN:
                    break
                self._log.went_idle()
                self._idle()
                continue
            t0 = time.monotonic()
            touched = self._guarded(self.engine.advance)
            if touched is _BROKEN:
                break
            if touched is None:  # suspended: the owner replaces the model
                continue
            self.steps += 1
            t1 = time.monotonic()
            self._deliver(touched)
            self._publish()
            self._log.step(t0, t1, time.monotonic(), self.engine)
        self._parked.set()

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """``call()`` on the model; when it breaks: None (suspended, when ``recoverable``) or
        ``_BROKEN`` (the engine is dead: the loop ends). The watchdog sees it as a step."""
        self.step_started_at = time.monotonic()
        try:
            return call()
        except Exception as exc:  # the model broke: park until replaced or declared dead
            log.exception("engine step failed")
            self.failure = f"the engine failed a step ({type(exc).__name__})"
            if not self._recoverable:
                self.mark_dead(self.failure)
                return _BROKEN
            self._suspended = self._suspended or self.failure
            return None
        finally:
            self.step_started_at = None

    def _idle(self) -> None:
        self._wake.wait(self._idle_wait_s)
        self._wake.clear()

    def _drain_inbox(self) -> None:
        inbox = self._inbox
        refused: list[Request] = []
        while inbox:
            item = inbox.popleft()
            if isinstance(item, str):
                self.engine.abort_request(item)
                self._log.submitted.pop(item, None)
                continue
            self._log.submitted[item.request_id] = time.monotonic()
            try:
                self.engine.add_request(item.request_id, item.prompt_ids, item.params,
                                        prompt=item.prompt)
            except ValueError as exc:  # checked by the caller; e.g. an id reused meanwhile
                refused.append(_refused(item, str(exc)))
        if refused:
            self._deliver(refused)

    def _deliver(self, requests: Sequence[Request]) -> None:
        """Every listener's news of ``requests``: one hand-over per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req in requests:
            if req.finished:
                self._log.finished(req)
            sink = self._sinks.get(req.request_id)
            if sink is None:
                continue
            if req.finished:
                self._sinks.pop(req.request_id, None)
            if isinstance(sink, Outbox):
                item = delta_record(req)
                if item is None:
                    continue
            else:
                item = build_output(req, self.engine.tokenizer)
            by_loop.setdefault(sink.loop, []).append((sink, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_hand_over, items)
            except RuntimeError:  # that caller's loop is closed: nobody is listening
                pass

    def _publish(self) -> None:
        self._snapshot = engine_snapshot(self.engine, self._dead, self.steps)

    # ------------------------------------------------------------------ a broken model

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def unhealthy_reason(self) -> str | None:
        return self._dead or self._suspended

    def suspend(self, reason: str) -> None:
        """Stop stepping (the model is broken): requests wait, new ones queue. Returns at
        once; the loop parks as soon as the step it may be in returns or raises."""
        self._suspended = self._suspended or reason
        self._wake.set()

    def resume(self, engine: Engine, wait_s: float = 30.0) -> None:
        """Go on with ``engine``: it adopts every unfinished request of the broken one (they
        keep their tokens and are prefilled again). If the old loop is still inside a step
        after ``wait_s`` (a collective that never returns), its requests cannot be handed
        over safely: they end with an error that keeps their tokens, and a new loop starts."""
        old = self.engine
        if self._parked.wait(wait_s):
            engine.adopt(old)
        else:
            log.error("the engine loop is still inside a step after %.0f s; failing its "
                      "requests and starting a new loop", wait_s)
            self._deliver(old.fail_all("an expert-parallel rank failed during this request"))
            self._thread = self._start_thread()
        self.engine = engine
        self._watch_arrivals(engine)
        self.failure = None
        self._suspended = None
        self._snapshot = engine_snapshot(engine, None, self.steps)
        self._wake.set()

    def mark_dead(self, reason: str) -> None:
        """No engine will come back: end every request now (with the tokens it has) and
        refuse new ones. Does not wait for the engine thread (it may be stuck)."""
        self._dead = self._dead or reason
        self._stop = True
        self._wake.set()
        ended = self.engine.fail_all(reason)
        ended += [_refused(item, reason) for item in list(self._inbox) if isinstance(item, _Add)]
        self._inbox.clear()
        self._deliver(ended)
        for rid in list(self._sinks):  # anything left (never reached the engine): end it too
            self._deliver([_refused(_Add(rid, [], SamplingParams(), None), reason)])
        self._sinks.clear()
        self._snapshot = engine_snapshot(self.engine, self._dead, self.steps)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        if self._dead is None:
            self.mark_dead("the engine was shut down")

    # ------------------------------------------------------------------ requests

    def submit(self, outbox: Outbox, request_id: str, prompt_ids: Sequence[int],
               params: SamplingParams, prompt: str | None = None) -> None:
        """Queue a request whose news goes to ``outbox``; ``ValueError`` (naming the field)
        when it cannot be served, ``EngineDead`` when nothing can. Call on ``outbox.loop``."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        ids = self.engine.check_request(prompt_ids, params)  # config only: no engine state
        if request_id in self._sinks:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._sinks[request_id] = outbox
        outbox.requests.add(request_id)
        self._inbox.append(_Add(request_id, ids, params, prompt))
        self._wake.set()

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after each step that changed it; the last
        one is finished. ``ValueError`` (before anything yields) for an invalid request."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        ids = self.engine.check_request(prompt_ids, params)
        if request_id in self._sinks:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream()
        self._sinks[request_id] = stream
        self._inbox.append(_Add(request_id, ids, params, prompt))
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV (on the engine thread, before its next step)."""
        self._sinks.pop(request_id, None)
        self._inbox.append(request_id)
        self._wake.set()

    def snapshot(self) -> EngineSnapshot:
        """The counters as of the last step (never waits for the engine thread)."""
        return self._snapshot


_BROKEN = object()  # _guarded's answer when the engine died


def _hand_over(items: list) -> None:
    for sink, item in items:
        sink.put([item])


def _refused(item: _Add, reason: str) -> Request:
    """A request that never ran, finished with ``reason`` (for its listener)."""
    req = Request(item.request_id, item.prompt, list(item.prompt_ids), item.params, 0, -1)
    req.error = reason
    return req


def engine_snapshot(eng: Engine, dead: str | None, steps: int = 0) -> EngineSnapshot:
    """The engine's counters now (call with the engine idle or from its own thread)."""
    sched = eng.scheduler
    return EngineSnapshot(
        healthy=dead is None, reason=dead,
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        kv_usage=eng.model.kv_cache_usage(),
        prompt_tokens=eng.stats.prompt_tokens, generation_tokens=eng.stats.generation_tokens,
        num_preemptions=sched.num_preemptions, finished=dict(eng.stats.finished), steps=steps,
        prefix_cache_queries=sched.prefix_cache_queries,
        prefix_cache_hits=sched.prefix_cache_hits, histograms=eng.timings.export(),
        spec_decode=_spec_decode(eng))


def _spec_decode(eng: Engine) -> dict | None:
    if eng.cfg.speculative is None:
        return None
    s, k = eng.stats.spec, eng.cfg.speculative.num_speculative_tokens
    per = list(s.accepted_per_pos or ())
    return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "accepted_per_pos": per + [0] * (k - len(per))}


def error_output(request_id: str, reason: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[],
                         outputs=[CompletionOutput(index=0, finish_reason="error")],
                         finished=True, error=reason)
