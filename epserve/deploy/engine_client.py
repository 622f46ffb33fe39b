"""EngineClient: the ingress's side of the HeadActor (streams, aborts, health, stats).

Invariants: every stream this client opens ends — with a finished output, or with an
``ApiError`` (400 for a request the engine refused, 503 when the engine or its actor is
gone, 500 for a request the engine failed) — and a stream that ends any other way (client
gone, cancelled, error) aborts its request on the head, so its KV is freed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Sequence

from epserve.deploy.errors import ApiError, from_value_error
from epserve.deploy.metrics import RequestTimer
from epserve.head.async_engine import EngineDead
from epserve.head.outputs import RequestOutput

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0
#: /health answers within a second whatever the head does: a head that does not answer the
#: probe in this time is reported unhealthy (503), never waited for.
HEALTH_TIMEOUT_S = 0.8


def _unavailable(why: str) -> ApiError:
    return ApiError(503, f"the engine is not available: {why}", code="engine_unavailable")


class EngineClient:
    """Wraps a HeadActor handle (``cluster.bringup.start_head``)."""

    def __init__(self, head: Any):
        self.head = head

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

    def abort(self, request_id: str) -> None:
        try:
            self.head.abort.remote(request_id)
        except Exception:  # the head is gone: nothing left to free
            log.debug("abort(%s) not sent", request_id, exc_info=True)

    async def stream(self, request_id: str, prompt_ids: Sequence[int], params: dict[str, Any],
                     prompt: str | None, param: str = "prompt",
                     timer: RequestTimer | None = None) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs; the last one is finished and has no error.
        ``timer`` observes its latencies as outputs arrive."""
        from ray.exceptions import RayActorError, RayTaskError

        finished = False
        gen = None
        try:
            gen = self.head.generate.remote(request_id, list(prompt_ids), params, prompt)
            async for ref in gen:
                out: RequestOutput = await ref
                if out.error is not None:
                    raise ApiError(500, f"the engine failed this request: {out.error}",
                                   code="engine_error")
                finished = out.finished
                if timer is not None:
                    timer.on_output(out)
                yield out
                if finished:
                    return
            raise ApiError(500, "the engine ended the stream before the request finished",
                           code="engine_error")
        except RayActorError as exc:
            raise _unavailable(f"the head actor died ({type(exc).__name__})") from None
        except EngineDead as exc:
            raise _unavailable(str(getattr(exc, "cause", exc))) from None
        except ValueError as exc:
            raise from_value_error(exc, default_param=param) from None
        except RayTaskError as exc:  # a bug in the head: its text is for the log only
            log.error("request %s: the head raised %s", request_id, exc)
            raise ApiError(500, f"the engine failed ({type(getattr(exc, 'cause', exc)).__name__})",
                           code="engine_error") from None
        finally:
            if not finished:
                self.abort(request_id)
                if gen is not None:
                    _cancel(gen)


def _cancel(gen: Any) -> None:
    """End the head's side of an abandoned stream: an unconsumed Ray generator task would
    otherwise wait on its queue forever."""
    import ray

    try:
        ray.cancel(gen)
    except Exception:
        log.debug("cancel of an abandoned stream failed", exc_info=True)
