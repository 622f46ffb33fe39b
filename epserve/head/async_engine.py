"""AsyncEngine: drives an Engine on its own thread and streams outputs to asyncio callers.

Invariants: only the engine thread touches the Engine (adds and aborts are queued in an inbox
it drains before each step), so no caller ever waits on a lock the engine thread holds during
a step: an event loop that calls ``generate``, ``abort``, ``snapshot`` or ``health`` never
blocks, even while a step is stuck in a collective. Every request's stream ends (finished
output, or an error output that keeps the tokens it had) — a caller never waits forever; a
caller that stops listening aborts its request, so its KV is freed. When the model breaks
(a rank died), the engine can be replaced: ``suspend`` parks the loop, ``resume`` hands every
unfinished and queued request to the new engine, which prefills them again and goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from epserve.head.engine import Engine
from epserve.head.outputs import CompletionOutput, RequestOutput
from epserve.head.sampling_params import SamplingParams

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


class EngineDead(RuntimeError):
    """The engine loop has stopped (a failure, or shutdown); no request can be served."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None


class AsyncEngine:
    """Thread-backed engine loop with per-request asyncio queues."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05, recoverable: bool = False):
        """``recoverable``: the owner replaces a broken engine (``resume``) or gives up
        (``mark_dead``); otherwise a failed step ends every request at once."""
        self.engine = engine
        self._recoverable = recoverable
        self._inbox: deque[_Add | str] = deque()  # adds, and request ids to abort
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: str | None = None
        self._suspended: str | None = None
        self._stop = False
        self._idle_wait_s = idle_wait_s
        self._parked = threading.Event()  # set while the loop is outside any step, suspended
        self.failure: str | None = None  # why the last step broke the engine, if it did
        self.step_started_at: float | None = None
        self._snapshot = engine_snapshot(engine, None)
        self._thread = self._start_thread()

    def _start_thread(self) -> threading.Thread:
        t = threading.Thread(target=self._loop, name="epserve-engine", daemon=True)
        t.start()
        return t

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self._stop:
            if self._suspended is not None:
                self._parked.set()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            self._parked.clear()
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._publish()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                self.step_started_at = time.monotonic()
                outs = self.engine.step()
            except Exception as exc:  # the model broke: park until replaced or declared dead
                log.exception("engine step failed")
                self.failure = f"the engine failed a step ({type(exc).__name__})"
                if not self._recoverable:
                    self.mark_dead(self.failure)
                    break
                self._suspended = self._suspended or self.failure
                continue
            finally:
                self.step_started_at = None
            self._deliver(outs)
            self._publish()
        self._parked.set()

    def _drain_inbox(self) -> None:
        inbox = self._inbox
        while inbox:
            item = inbox.popleft()
            if isinstance(item, str):
                self.engine.abort_request(item)
                continue
            try:
                self.engine.add_request(item.request_id, item.prompt_ids, item.params,
                                        prompt=item.prompt)
            except ValueError as exc:  # checked by the caller; e.g. an id reused meanwhile
                self._deliver([_error_output(item.request_id, str(exc))])

    def _deliver(self, outs: Sequence[RequestOutput]) -> None:
        """One wake-up per event loop per step, whatever the number of outputs."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            entry = self._queues.get(out.request_id)
            if entry is None:
                continue
            loop, queue = entry
            if out.finished:
                self._queues.pop(out.request_id, None)
            by_loop.setdefault(loop, []).append((queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that caller's loop is closed: nobody is listening
                pass

    def _publish(self) -> None:
        self._snapshot = engine_snapshot(self.engine, self._dead)

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
        self.failure = None
        self._suspended = None
        self._snapshot = engine_snapshot(engine, None)
        self._wake.set()

    def mark_dead(self, reason: str) -> None:
        """No engine will come back: end every request now (with the tokens it has) and
        refuse new ones. Does not wait for the engine thread (it may be stuck)."""
        self._dead = self._dead or reason
        self._stop = True
        self._wake.set()
        outs = self.engine.fail_all(reason)
        queued = [item for item in self._inbox if isinstance(item, _Add)]
        self._inbox.clear()
        outs += [_error_output(item.request_id, reason) for item in queued]
        self._deliver(outs)
        for rid, (loop, queue) in list(self._queues.items()):  # anything left: end it too
            try:
                loop.call_soon_threadsafe(queue.put_nowait, _error_output(rid, reason))
            except RuntimeError:
                pass
        self._queues.clear()
        self._snapshot = engine_snapshot(self.engine, self._dead)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        if self._dead is None:
            self.mark_dead("the engine was shut down")

    # ------------------------------------------------------------------ requests

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after each step that changed it; the last
        one is finished. ``ValueError`` (before anything yields) for an invalid request."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        ids = self.engine.check_request(prompt_ids, params)  # config only: no engine state
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        self._inbox.append(_Add(request_id, ids, params, prompt))
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV (on the engine thread, before its next step)."""
        self._queues.pop(request_id, None)
        self._inbox.append(request_id)
        self._wake.set()

    def snapshot(self) -> EngineSnapshot:
        """The counters as of the last step (never waits for the engine thread)."""
        return self._snapshot


def _put_all(items: list) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def engine_snapshot(eng: Engine, dead: str | None) -> EngineSnapshot:
    """The engine's counters now (call with the engine idle or from its own thread)."""
    sched = eng.scheduler
    return EngineSnapshot(
        healthy=dead is None, reason=dead,
        num_running=len(sched.running), num_waiting=len(sched.waiting),
        kv_usage=eng.model.kv_cache_usage(),
        prompt_tokens=eng.stats.prompt_tokens, generation_tokens=eng.stats.generation_tokens,
        num_preemptions=sched.num_preemptions, finished=dict(eng.stats.finished))


def _error_output(request_id: str, reason: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[],
                         outputs=[CompletionOutput(index=0, finish_reason="error")],
                         finished=True, error=reason)
