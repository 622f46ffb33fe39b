"""HeadActor: the Ray actor that owns the Engine and rank 0 (its ``StepModel``).

Client-facing calls only (generate as a stream, abort, health, stats, info); the per-step
command traffic to other ranks never goes through Ray calls. Invariants: arguments are plain
values (dicts, lists, strings); an invalid request raises ``ValueError`` before anything is
queued; no client call waits for the engine thread, so ``health`` and ``stats`` answer at once
even while a step is stuck; every stream ends. A dead or silent rank is noticed by a watchdog
(a ping unanswered for 2 s, actor death, a failed step, or a step past its deadline): health
turns unhealthy at once, the group is re-formed in this same process, and every in-flight or
newly arrived request waits and then goes on in the new group with the tokens it already had;
only when re-forming fails do they end, with an error and their tokens so far.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import threading
import time
from typing import Any

from epserve.cluster.cpu_threads import freeze_heap, set_engine_threads
from epserve.cluster.engine_args import EngineArgs, build_engine
from epserve.head.async_engine import AsyncEngine, Outbox
from epserve.head.output_stream import Submission, encode_records
from epserve.head.outputs import RequestOutput
from epserve.head.sampling_params import SamplingParams

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.5
#: A client that has not polled for this long is gone: its requests are aborted.
CLIENT_TIMEOUT_S = 30.0


class HeadActor:
    """Engine + leader runner; wrapped with ``ray.remote`` by ``cluster.bringup``."""

    def __init__(self, engine_args: dict[str, Any], placement_group: Any = None,
                 step_deadline_s: float = 60.0):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.args = EngineArgs.from_dict(engine_args).resolved()
        self.placement_group = placement_group
        self.group = None
        if self.args.ep_size > 1:  # first: the ranks' processes load while this one does
            from epserve.cluster.ep_group import EpGroup

            self.group = EpGroup(self.args, placement_group)
        set_engine_threads(self.args.device)
        self.step_deadline_s = step_deadline_s
        self._reforming = False
        self._unhealthy: str | None = None
        self.reforms = 0
        self._outboxes: dict[str, Outbox] = {}
        self._reaper: asyncio.Task | None = None
        self.engine, self.runner, self.tokenizer = self._build()
        self.aengine = AsyncEngine(self.engine, recoverable=self.args.ep_size > 1)
        if self.args.ep_size > 1:
            threading.Thread(target=self._watch, name="epserve-watchdog", daemon=True).start()
        freeze_heap()

    def _build(self) -> tuple[Any, Any, Any]:
        """A new engine (and, with EP, a new group of ranks, unless they are starting)."""
        runner = None
        if self.args.ep_size > 1:
            from epserve.cluster.ep_group import EpGroup

            if self.group is None:
                self.group = EpGroup(self.args, self.placement_group)
            try:
                self.group.join()
            except BaseException:  # no half-made group stays: its ranks go now
                self.group.shutdown(graceful=False)
                self.group = None
                raise
            runner = self.group.leader
        return build_engine(self.args, runner=runner)

    # ------------------------------------------------------------------ health

    def _watch(self) -> None:
        """Notice a dead or stuck rank within seconds, then re-form the group. In-flight
        requests wait for the new group and go on there (prefilled again from their tokens)."""
        while True:
            time.sleep(WATCH_PERIOD_S)
            if self.aengine.dead_reason is not None:
                return
            reason = self._dead_reason()
            if reason is None:
                continue
            log.error("EP group unhealthy: %s; re-forming it", reason)
            self._unhealthy = reason
            self.aengine.suspend(reason)
            self._reform()

    def _dead_reason(self) -> str | None:
        started = self.aengine.step_started_at
        if started is not None and time.monotonic() - started > self.step_deadline_s:
            return f"a step ran past its {self.step_deadline_s:.0f} s deadline"
        if self.aengine.failure is not None:
            return self.aengine.failure
        return self.group.alive(timeout_s=2.0) if self.group is not None else None

    def _reform(self) -> None:
        self._reforming = True
        try:
            old = self.group
            self.group = None
            if old is not None:  # kills the ranks: a step stuck on one of them now fails
                old.shutdown(graceful=False)
            old = None
            engine, self.runner, self.tokenizer = self._build()
            self.aengine.resume(engine)
            self.engine = engine
            self._unhealthy = None
            self.reforms += 1
            log.info("EP group re-formed with %d ranks", self.args.ep_size)
        except Exception as exc:
            log.exception("re-forming the EP group failed")
            self._unhealthy = f"re-forming the EP group failed ({type(exc).__name__})"
            self.aengine.mark_dead(self._unhealthy)
        finally:
            self._reforming = False
            _release_memory()

    # ------------------------------------------------------------------ client calls

    def ready(self) -> dict[str, Any]:
        """Model facts the ingress needs (also a liveness probe)."""
        return {
            "model": self.args.model,
            "served_model_name": self.args.served_model_name or self.args.model,
            "max_model_len": self.runner.max_model_len,
            "vocab_size": self.runner.model_config.vocab_size,
            "ep_size": self.args.ep_size,
            "limits": dataclasses.asdict(self.args.request_limits(
                self.runner.model_config.vocab_size)),  # max_logprobs -1 resolved
            "cache_config": {  # vllm:cache_config_info's labels
                "block_size": str(self.args.block_size),
                "num_gpu_blocks": str(self.runner.num_total_blocks()),
                "enable_prefix_caching": str(self.runner.prefix_caching),
                "gpu_memory_utilization": str(self.args.gpu_memory_utilization)},
        }

    # The client channel: a client (an ingress replica, a remote LLM) submits requests in
    # batches and long-polls for its requests' news, one message per poll with every record
    # since the last: one actor call per client per engine step at most, whatever the number
    # of requests and tokens (not one Ray object per token).

    async def submit(self, client_id: str, requests: list[list]) -> list[str | None]:
        """Queue each request (``Submission.to_wire()``); per request None, or why it was
        refused (a ``ValueError`` message naming the field). ``EngineDead`` when the engine
        cannot serve anything."""
        outbox = self._outbox(client_id)
        errors: list[str | None] = []
        for wire in requests:
            sub = Submission.from_wire(wire)
            try:
                self.aengine.submit(outbox, sub.request_id, sub.prompt_token_ids,
                                    SamplingParams(**sub.params), sub.prompt)
                errors.append(None)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        return errors

    async def poll(self, client_id: str, wait_s: float = 1.0) -> bytes:
        """Every delta record for this client's requests since its last poll (one msgpack
        frame, ``head.output_stream``), waiting up to ``wait_s`` for the first."""
        return encode_records(await self._outbox(client_id).take(wait_s))

    async def abort_many(self, client_id: str, request_ids: list[str]) -> None:
        outbox = self._outboxes.get(client_id)
        for rid in request_ids:
            self.aengine.abort(rid)
            if outbox is not None:
                outbox.requests.discard(rid)

    def _outbox(self, client_id: str) -> Outbox:
        box = self._outboxes.get(client_id)
        if box is None:
            box = self._outboxes[client_id] = Outbox(client_id)
            if self._reaper is None:
                self._reaper = asyncio.get_running_loop().create_task(self._reap_clients())
        return box

    async def _reap_clients(self) -> None:
        """A client that stopped polling (its replica died) has its requests aborted, so
        their KV is freed."""
        while True:
            await asyncio.sleep(CLIENT_TIMEOUT_S / 4)
            now = time.monotonic()
            for cid, box in list(self._outboxes.items()):
                if now - box.last_seen > CLIENT_TIMEOUT_S:
                    log.warning("client %s stopped polling; aborting its %d requests", cid,
                                len(box.requests))
                    for rid in box.requests:
                        self.aengine.abort(rid)
                    del self._outboxes[cid]

    async def generate_batch(self, requests: list[dict[str, Any]]) -> list[RequestOutput]:
        """Final outputs of several requests (the offline API over EP). Every request is
        checked first: one invalid request raises ``ValueError`` and none runs."""
        parsed = []
        for i, req in enumerate(requests):
            try:
                parsed.append((SamplingParams(**req["params"]), list(req["prompt_token_ids"])))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"prompts[{i}]: {exc}") from None
        for i, (sp, ids) in enumerate(parsed):
            try:
                self.engine.check_request(ids, sp)
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
        """Never waits for the engine thread: answers at once even while a step is stuck."""
        reason = self._unhealthy or self.aengine.unhealthy_reason
        if self._reforming:
            reason = reason or "re-forming the EP group"
        return {"healthy": reason is None, "reason": reason}

    async def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.aengine.snapshot())

    async def worker_failures(self) -> list[list[dict[str, Any]]]:
        """Each EP worker's logged ``EpCommandFailed`` records (rank 1 first)."""
        group = self.group
        if group is None:
            return []
        return list(await asyncio.gather(*(w.failures.remote() for w in group.workers)))

    def pid(self) -> int:
        """This process's id (fault tests freeze it)."""
        return os.getpid()

    def memory_rss(self) -> int:
        """This process's resident memory in bytes (the re-form memory test reads it)."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

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


def _release_memory() -> None:
    """Give the old engine's memory back after a re-form: its model and KV cache are garbage
    now, but glibc keeps freed heap pages unless asked (RSS grew ~200 MB per re-form). The
    heap is frozen again (``freeze_heap``, which first releases the old engine frozen with it
    and collects its cycles)."""
    freeze_heap()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
