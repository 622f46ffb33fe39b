"""EpWorker: the Ray actor that holds one EP rank above 0 and loops on its step commands.

Invariants: commands arrive on the torch.distributed channel, never as Ray calls; a command
that fails validation is logged (``EpCommandFailed`` with step id and reason), recorded and
skipped; a broken channel ends the process, so Ray reports the actor dead to the head.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from epserve.cluster.cpu_threads import freeze_heap, set_engine_threads
from epserve.cluster.engine_args import EngineArgs

log = logging.getLogger("epserve.ep_worker")


class EpWorker:
    """Rank ``rank`` of ``world_size``; wrapped with ``ray.remote`` by ``cluster.ep_group``."""

    def __init__(self, engine_args: dict[str, Any], rank: int, world_size: int):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.args = EngineArgs.from_dict(engine_args)
        self.rank = rank
        self.world_size = world_size
        self.executor = None
        self._thread: threading.Thread | None = None

    def init(self, addr: str, port: int) -> dict[str, Any]:
        """Join the group, load this rank's expert shard; returns model facts."""
        from epserve.models.config import ModelConfig
        from epserve.models.parallel import ParallelInfo
        from epserve.worker.ep_comm import EpComm
        from epserve.worker.ep_dist import join_ep_group
        from epserve.worker.rank_executor import RankExecutor
        from epserve.worker.runner import Runner, resolve_device

        cfg = self.args.runner_config()
        set_engine_threads(cfg.device)
        mc = ModelConfig.from_pretrained(cfg.model)
        ParallelInfo(self.rank, self.world_size).local_expert_range(mc.num_experts)
        group, cpu_group = join_ep_group(self.rank, self.world_size, addr, port,
                                         resolve_device(cfg.device).type,
                                         self.args.ep_timeout_s)
        comm = EpComm(self.rank, self.world_size, mc.num_experts, group, cpu_group)
        runner = Runner(cfg, ParallelInfo(self.rank, self.world_size, comm))
        self.executor = RankExecutor(runner, comm, self.rank, self.world_size)
        freeze_heap()
        return {"rank": self.rank, "num_blocks": runner.num_blocks, "pid": os.getpid()}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"ep-rank-{self.rank}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while self.executor.ep_worker_step():
                pass
            log.info("rank %d: shutdown command, leaving", self.rank)
        except Exception as exc:  # the channel or a collective broke: this rank is done
            log.error("rank %d: channel broken (%s: %s); exiting", self.rank,
                      type(exc).__name__, exc)
        os._exit(0)

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        """This rank's process id (fault tests freeze or kill it)."""
        return os.getpid()

    def failures(self) -> list[dict[str, Any]]:
        """Every ``EpCommandFailed`` this rank logged: step id and reason."""
        return [{"step_id": f.step_id, "reason": f.reason} for f in self.executor.failures]
