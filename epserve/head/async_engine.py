"""AsyncEngine: drives an Engine on its own thread and streams outputs to asyncio callers.

Invariants: only the engine thread calls ``Engine.step``; adds and aborts take the same lock,
so the engine is never entered twice at once; every request's stream ends (finished output,
or an error output when the engine fails or is stopped) — a caller never waits forever; a
caller that stops listening aborts its request, so its KV is freed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from epserve.head.engine import Engine
from epserve.head.outputs import CompletionOutput, RequestOutput
from epserve.head.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EngineSnapshot:
    """What /metrics and /health read, taken under the engine lock."""

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


class AsyncEngine:
    """Thread-backed engine loop with per-request asyncio queues."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead: str | None = None
        self._stop = False
        self._idle_wait_s = idle_wait_s
        self.step_started_at: float | None = None
        self._thread = threading.Thread(target=self._loop, name="epserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished():
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    self.step_started_at = time.monotonic()
                    outs = self.engine.step()
                    self.step_started_at = None
            except Exception as exc:  # the engine itself broke: fail everyone, stay dead
                log.exception("engine loop failed")
                self._die(f"engine failed: {exc}")
                return
            for out in outs:
                self._deliver(out)
        self._die("engine stopped")

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._queues.get(out.request_id)
        if entry is None:
            return
        loop, queue = entry
        if out.finished:
            self._queues.pop(out.request_id, None)
        loop.call_soon_threadsafe(queue.put_nowait, out)

    def _die(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        for rid, (loop, queue) in list(self._queues.items()):
            loop.call_soon_threadsafe(queue.put_nowait, _error_output(rid, reason))
        self._queues.clear()

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def mark_dead(self, reason: str) -> None:
        """Called from outside (e.g. a rank died): fail every in-flight request now. Does not
        wait for the engine lock: the engine thread may be stuck in a collective."""
        self._stop = True
        self._wake.set()
        self._die(reason)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ requests

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after each step that changed it; the last
        one is finished. ``ValueError`` (before anything yields) for an invalid request."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            with self._lock:
                self.engine.add_request(request_id, prompt_ids, params, prompt=prompt)
        except Exception:
            self._queues.pop(request_id, None)
            raise
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
        self._queues.pop(request_id, None)
        with self._lock:
            self.engine.abort_request(request_id)

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            return engine_snapshot(self.engine, self._dead)


def engine_snapshot(eng: Engine, dead: str | None) -> EngineSnapshot:
    """The engine's counters now (call with the engine idle or its lock held)."""
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

