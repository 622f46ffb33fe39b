"""EngineClient: the ingress's side of the HeadActor (submissions, outputs, aborts, health).

The channel (``head.output_stream``): requests started on this replica within one event-loop
turn (or while the previous submission call is in flight) travel to the head in one ``submit``
call; one long-poll loop per replica fetches every one of its requests' news in one message
per engine step (or per few steps when the head is faster than a call); the records are
applied to each request's cumulative output and its waiter is woken. A reader that lags sees
only the latest state, so its next chunk carries every token since the last (coalescing).

Invariants: every stream this client opens ends — with a finished output, or with an
``ApiError`` (400 for a request the engine refused, 503 when the engine or its actor is gone,
500 for a request the engine failed) — and a stream that ends any other way (client gone,
cancelled, error) aborts its request on the head, so its KV is freed; a submission and the
abort of the same request reach the head in that order.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from epserve.deploy.errors import ApiError, from_value_error
from epserve.deploy.metrics import RequestTimer
from epserve.head.async_engine import EngineDead
from epserve.head.output_stream import OutputAccumulator, Submission, decode_records
from epserve.head.outputs import RequestOutput

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0
#: /health answers within a second whatever the head does: a head that does not answer the
#: probe in this time is reported unhealthy (503), never waited for.
HEALTH_TIMEOUT_S = 0.8
#: How long one poll waits at the head for news before it returns empty and polls again.
POLL_WAIT_S = 1.0
SUBMIT_TIMEOUT_S = 60.0


def _unavailable(why: str) -> ApiError:
    return ApiError(503, f"the engine is not available: {why}", code="engine_unavailable")


class _Live:
    """One open request: its cumulative output, and a flag its reader waits on."""

    __slots__ = ("acc", "changed", "failure")

    def __init__(self, acc: OutputAccumulator):
        self.acc = acc
        self.changed = asyncio.Event()
        self.failure: ApiError | None = None


class EngineClient:
    """Wraps a HeadActor handle (``cluster.bringup.start_head``). ``decode``: token id -> text,
    for the logprob dicts this side builds."""

    def __init__(self, head: Any, decode: Callable[[int], str] | None = None):
        self.head = head
        self.decode = decode
        self.client_id = f"ingress-{uuid.uuid4().hex[:12]}"
        self._live: dict[str, _Live] = {}
        self._submits: list[tuple[Submission, asyncio.Future]] = []
        self._aborts: list[str] = []
        self._flusher: asyncio.Task | None = None
        self._poller: asyncio.Task | None = None
        self.polls = 0  # messages received from the head (the mechanism test reads it)

    async def _call(self, method: str, *args: Any, timeout: float = PROBE_TIMEOUT_S) -> Any:
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            ref = getattr(self.head, method).remote(*args)
            return await asyncio.wait_for(ref, timeout)
        except (RayActorError, asyncio.TimeoutError, GetTimeoutError) as exc:
            raise _unavailable(f"{method}() failed ({type(exc).__name__})") from None

    async def ready(self) -> dict[str, Any]:
        return await self._call("ready", timeout=600.0)

    async def stats(self) -> dict[str, Any]:
        return await self._call("stats")

    async def health(self) -> tuple[bool, str | None]:
        """(healthy, reason); a dead or unresponsive head is unhealthy."""
        try:
            h = await self._call("health", timeout=HEALTH_TIMEOUT_S)
        except ApiError as exc:
            return False, exc.message
        return bool(h.get("healthy")), h.get("reason")

    # ------------------------------------------------------------------ one request

    async def stream(self, request_id: str, prompt_ids: Sequence[int], params: dict[str, Any],
                     prompt: str | None, param: str = "prompt",
                     timer: RequestTimer | None = None) -> AsyncIterator[RequestOutput]:
        """The request's cumulative output, each time it changed (the latest state only, when
        several changes arrived since the last); the last one is finished and has no error.
        ``timer`` observes its latencies as outputs arrive."""
        acc = OutputAccumulator(request_id, prompt, list(prompt_ids), int(params.get("n", 1)),
                                params.get("logprobs") is not None, self.decode)
        live = self._live[request_id] = _Live(acc)
        finished = False
        try:
            await self._submit(Submission(request_id, list(prompt_ids), params, prompt), param)
            self._ensure_poller()
            while True:
                await live.changed.wait()
                live.changed.clear()
                if live.failure is not None:
                    raise live.failure
                out = acc.output
                if out.error is not None:
                    raise ApiError(500, f"the engine failed this request: {out.error}",
                                   code="engine_error")
                finished = out.finished
                if timer is not None:
                    timer.on_output(out)
                yield out
                if finished:
                    return
        finally:
            self._live.pop(request_id, None)
            if not finished:
                self._aborts.append(request_id)
                self._kick()

    async def _submit(self, sub: Submission, param: str) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._submits.append((sub, fut))
        self._kick()
        error = await fut
        if error is not None:
            raise from_value_error(ValueError(error), default_param=param)

    # ------------------------------------------------------------------ the channel

    def _kick(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = _detached(self._flush())

    async def _flush(self) -> None:
        """Send what is queued: every submission of this loop turn in one call, then aborts."""
        while self._submits or self._aborts:
            await asyncio.sleep(0)  # the rest of this turn's requests join the batch
            subs = [(s, f) for s, f in self._submits if not f.done()]
            aborts, self._submits, self._aborts = self._aborts, [], []
            ref = self.head.submit.remote(self.client_id, [s.to_wire() for s, _ in subs]) \
                if subs else None
            if aborts:  # after the submissions, so an abort never overtakes its request
                self.head.abort_many.remote(self.client_id, aborts)
            if ref is not None:
                await self._answer(ref, subs)

    async def _answer(self, ref: Any, subs: list[tuple[Submission, asyncio.Future]]) -> None:
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            errors = await asyncio.wait_for(ref, SUBMIT_TIMEOUT_S)
        except EngineDead as exc:
            failure = _unavailable(str(getattr(exc, "cause", exc)))
        except (RayActorError, asyncio.TimeoutError, GetTimeoutError) as exc:
            failure = _unavailable(f"submit() failed ({type(exc).__name__})")
        except Exception as exc:  # a bug in the head: its text is for the log only
            log.error("submit to the head failed: %s", exc)
            failure = ApiError(500, f"the engine failed ({type(exc).__name__})",
                               code="engine_error")
        else:
            for (_, fut), err in zip(subs, errors):
                if not fut.done():
                    fut.set_result(err)
            return
        for _, fut in subs:
            if not fut.done():
                fut.set_exception(failure)

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = _detached(self._poll())

    async def _poll(self) -> None:
        """Fetch this replica's news while it has open requests."""
        from ray.exceptions import RayActorError

        while self._live:
            try:
                frame = await self.head.poll.remote(self.client_id, POLL_WAIT_S)
            except RayActorError as exc:
                self._fail_all(_unavailable(f"the head actor died ({type(exc).__name__})"))
                return
            except Exception as exc:
                log.error("polling the head failed: %s", exc)
                self._fail_all(ApiError(500, f"the engine failed ({type(exc).__name__})",
                                        code="engine_error"))
                return
            self.polls += 1
            for rec in decode_records(frame):
                live = self._live.get(rec[0])
                if live is not None:
                    live.acc.apply(rec)
                    live.changed.set()

    def _fail_all(self, failure: ApiError) -> None:
        for live in self._live.values():
            live.failure = failure
            live.changed.set()


def _detached(coro: Any) -> asyncio.Task:
    """A task of this replica, not of the request that happened to start it: created in a
    fresh context, so Serve's cancellation of that request (its client left) does not cancel
    the head calls it makes for every request (which failed the others' streams)."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
