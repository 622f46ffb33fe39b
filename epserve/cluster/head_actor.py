"""HeadActor: the Ray actor that owns the Engine and the rank-0 Runner (the EP leader).

Client-facing calls only (generate as a stream, abort, health, stats, info); the per-step
command traffic to other ranks never goes through Ray calls. Invariants: arguments are plain
values (dicts, lists, strings); an invalid request raises ``ValueError`` before anything is
queued; every stream ends, with an error output when the engine or a rank has died; a dead
rank is noticed by a watchdog (actor death, or a step past its deadline), every in-flight
request is answered with an error at once, and the group is re-formed in this same process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, AsyncIterator, Sequence

from epserve.cluster.engine_args import EngineArgs, build_engine
from epserve.head.async_engine import AsyncEngine
from epserve.head.outputs import RequestOutput
from epserve.head.sampling_params import SamplingParams

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.5


class HeadActor:
    """Engine + leader runner; wrapped with ``ray.remote`` by ``cluster.bringup``."""

    def __init__(self, engine_args: dict[str, Any], placement_group: Any = None,
                 step_deadline_s: float = 60.0):
        self.args = EngineArgs.from_dict(engine_args).resolved()
        self.placement_group = placement_group
        self.step_deadline_s = step_deadline_s
        self.group = None
        self._state_lock = threading.Lock()
        self._reforming = False
        self._unhealthy: str | None = None
        self._start_engine()
        if self.args.ep_size > 1:
            threading.Thread(target=self._watch, name="epserve-watchdog", daemon=True).start()

    def _start_engine(self) -> None:
        runner = None
        if self.args.ep_size > 1:
            from epserve.cluster.ep_group import EpGroup

            self.group = EpGroup(self.args, self.placement_group)
            runner = self.group.leader
        self.engine, self.runner, self.tokenizer = build_engine(self.args, runner=runner)
        self.aengine = AsyncEngine(self.engine)

    # ------------------------------------------------------------------ health

    def _watch(self) -> None:
        """Fail fast on a dead rank, then re-form the group."""
        while True:
            time.sleep(WATCH_PERIOD_S)
            if self._reforming:
                continue
            reason = self._dead_reason()
            if reason is None:
                continue
            log.error("EP group unhealthy: %s; failing in-flight requests, re-forming", reason)
            self._unhealthy = reason
            self.aengine.mark_dead(reason)
            self._reform()

    def _dead_reason(self) -> str | None:
        started = self.aengine.step_started_at
        if started is not None and time.monotonic() - started > self.step_deadline_s:
            return f"a step ran past its {self.step_deadline_s:.0f} s deadline"
        if self.aengine.dead_reason is not None:
            return self.aengine.dead_reason
        return self.group.alive(timeout_s=2.0) if self.group is not None else None

    def _reform(self) -> None:
        with self._state_lock:
            self._reforming = True
            try:
                old = self.group
                self.aengine.shutdown()
                if old is not None:
                    old.shutdown(graceful=False)
                self._start_engine()
                self._unhealthy = None
                log.info("EP group re-formed with %d ranks", self.args.ep_size)
            except Exception as exc:
                log.exception("re-forming the EP group failed")
                self._unhealthy = f"re-forming the EP group failed: {exc}"
            finally:
                self._reforming = False

    # ------------------------------------------------------------------ client calls

    def ready(self) -> dict[str, Any]:
        """Model facts the ingress needs (also a liveness probe)."""
        return {
            "model": self.args.model,
            "served_model_name": self.args.served_model_name or self.args.model,
            "max_model_len": self.runner.max_model_len,
            "vocab_size": self.runner.model_config.vocab_size,
            "ep_size": self.args.ep_size,
        }

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: dict[str, Any],
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative ``RequestOutput``s of one request (Ray streaming generator)."""
        sp = SamplingParams(**params)
        async for out in self.aengine.generate(request_id, list(prompt_ids), sp, prompt):
            yield out

    async def generate_batch(self, requests: list[dict[str, Any]]) -> list[RequestOutput]:
        """Final outputs of several requests (the offline API over EP). Every request is
        checked first: one invalid request raises ``ValueError`` and none runs."""
        parsed = []
        for i, req in enumerate(requests):
            try:
                parsed.append((SamplingParams(**req["params"]), list(req["prompt_token_ids"])))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
        for i, (_, ids) in enumerate(parsed):
            try:
                self.engine._check_prompt(ids)
            except ValueError as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None

        async def one(i: int, sp: SamplingParams, ids: list[int]) -> RequestOutput:
            last = None
            rid = f"batch-{id(requests)}-{i}"
            async for last in self.aengine.generate(rid, ids, sp, requests[i].get("prompt")):
                pass
            return last

        return list(await asyncio.gather(*(one(i, sp, ids) for i, (sp, ids) in
                                           enumerate(parsed))))

    async def abort(self, request_id: str) -> None:
        self.aengine.abort(request_id)

    async def health(self) -> dict[str, Any]:
        reason = self._unhealthy or self.aengine.dead_reason
        if self._reforming:
            reason = reason or "re-forming the EP group"
        return {"healthy": reason is None, "reason": reason}

    async def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.aengine.snapshot())

    def worker_failures(self) -> list[list[dict[str, Any]]]:
        """Each EP worker's logged ``EpCommandFailed`` records (rank 1 first)."""
        return self.group.failures() if self.group is not None else []

    def worker_handles(self) -> list[Any]:
        return list(self.group.workers) if self.group is not None else []

    def capabilities(self) -> list[str]:
        return sorted(self.runner.capabilities())

    def inject_command_fault(self, kind: str) -> None:
        """Corrupt the next step command (tests of the keep-going contract)."""
        from epserve.cluster.faults import mutator

        if self.group is None:
            raise ValueError("inject_command_fault needs ep_size > 1")
        self.group.leader.inject_fault(mutator(kind))

    def shutdown(self) -> None:
        self.aengine.shutdown()
        if self.group is not None:
            self.group.shutdown(graceful=True)
