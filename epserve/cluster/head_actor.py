"""HeadActor: the Ray actor that owns the Engine and the rank-0 Runner (the EP leader).

Client-facing calls only (generate as a stream, abort, health, stats, info); the per-step
command traffic to other ranks never goes through Ray calls. Invariants: arguments are plain
values (dicts, lists, strings); an invalid request raises ``ValueError`` before anything is
queued; every stream ends, with an error output when the engine or a rank has died.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, AsyncIterator, Sequence

from epserve.cluster.engine_args import EngineArgs, build_engine
from epserve.head.async_engine import AsyncEngine
from epserve.head.outputs import RequestOutput
from epserve.head.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class HeadActor:
    """Engine + leader runner; wrapped with ``ray.remote`` by ``cluster.bringup``."""

    def __init__(self, engine_args: dict[str, Any], ep_group: Any = None):
        self.args = EngineArgs.from_dict(engine_args).resolved()
        runner = ep_group.leader_runner() if ep_group is not None else None
        self.ep_group = ep_group
        self.engine, self.runner, self.tokenizer = build_engine(self.args, runner=runner)
        self.aengine = AsyncEngine(self.engine)

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

    async def abort(self, request_id: str) -> None:
        self.aengine.abort(request_id)

    async def health(self) -> dict[str, Any]:
        snap = self.aengine.snapshot()
        return {"healthy": snap.healthy, "reason": snap.reason}

    async def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.aengine.snapshot())

    def shutdown(self) -> None:
        self.aengine.shutdown()
