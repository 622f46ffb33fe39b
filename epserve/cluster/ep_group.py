"""EpGroup: the N ranks of one EP engine, seen from the head: rank 0 here, EpWorkers on Ray.

Invariants: ranks 1..N-1 live in bundles 1..N-1 of the head's placement group (bundle 0
holds the head); the rendezvous address and port are picked here and handed to every rank;
an expert count that N does not divide is refused before any actor starts; ``alive`` answers
within its timeout, never hangs.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from epserve.cluster.engine_args import EngineArgs
from epserve.cluster.ep_worker import EpWorker

log = logging.getLogger(__name__)


def bundle(device_type: str) -> dict[str, float]:
    """One rank's placement-group bundle."""
    return {"GPU": 1.0, "CPU": 1.0} if device_type == "cuda" else {"CPU": 0.01}


def free_port(addr: str) -> int:
    """A TCP port free on ``addr`` now (the head hands it to every rank)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


class EpGroup:
    """Brings up ranks 1..N-1 as EpWorker actors and rank 0 (the leader) in this process.

    In two steps, so that the ranks' processes load while this one does: ``EpGroup(args,
    placement_group)`` starts the workers and their ``init`` and returns at once (it imports
    no torch: call it before anything in this process does); ``join()`` then makes rank 0 here
    and waits for the others (``leader`` is set by it)."""

    def __init__(self, args: EngineArgs, placement_group: Any):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from epserve.models.config import ModelConfig
        from epserve.models.parallel import ParallelInfo

        n = args.ep_size
        self.args, self.world_size, self.leader = args, n, None
        mc = ModelConfig.from_pretrained(args.model)
        ParallelInfo(0, n).local_expert_range(mc.num_experts)  # refuses E % N != 0
        self.num_experts = mc.num_experts
        self.addr = ray.util.get_node_ip_address()
        self.port = free_port(self.addr)
        actor = ray.remote(EpWorker)
        # a rank takes a GPU where its bundle holds one (the driver sized the bundles by device)
        self.workers = [actor.options(
            num_cpus=0, num_gpus=1 if placement_group.bundle_specs[i].get("GPU") else 0,
            max_concurrency=4, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=i)).remote(args.to_dict(), i, n)
            for i in range(1, n)]
        self._inits = [w.init.remote(self.addr, self.port) for w in self.workers]

    def join(self, init_timeout_s: float = 600.0) -> None:
        """Rank 0 joins the group and loads its shard here; returns once every rank has."""
        import ray

        from epserve.models.parallel import ParallelInfo
        from epserve.worker.channels import EpChannel
        from epserve.worker.ep_comm import EpComm
        from epserve.worker.ep_dist import join_ep_group
        from epserve.worker.rank_executor import RankExecutor
        from epserve.worker.runner import Runner, resolve_device
        from epserve.worker.step_model import StepModel

        args, n = self.args, self.world_size
        cfg = args.runner_config()
        group, cpu_group = join_ep_group(0, n, self.addr, self.port,
                                         resolve_device(cfg.device).type, args.ep_timeout_s)
        comm = EpComm(0, n, self.num_experts, group, cpu_group)
        runner = Runner(cfg, ParallelInfo(0, n, comm))
        ray.get(self._inits, timeout=init_timeout_s)
        self._inits = []
        for w in self.workers:
            w.start.remote()
        rank0 = RankExecutor(runner, comm, 0, n)
        self.leader = StepModel(rank0, EpChannel(rank0, comm), n,
                                keep_alive_s=args.ep_timeout_s / 4)

    def alive(self, timeout_s: float = 2.0) -> str | None:
        """None when every worker answers a ping in time, else why not."""
        import ray

        refs = [w.ping.remote() for w in self.workers]
        deadline = time.monotonic() + timeout_s
        for rank, ref in enumerate(refs, start=1):
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                return f"EP rank {rank} did not answer within {timeout_s:.1f} s"
            except Exception as exc:
                return f"EP rank {rank} is dead ({type(exc).__name__})"
        return None

    def failures(self) -> list[list[dict[str, Any]]]:
        """Each worker's logged EpCommandFailed records, rank 1 first."""
        import ray

        return ray.get([w.failures.remote() for w in self.workers], timeout=10)

    def shutdown(self, graceful: bool) -> None:
        """Stop every rank and leave the process group (graceful: send a shutdown command)."""
        import ray

        from epserve.worker.ep_dist import leave_ep_group

        if graceful and self.leader is not None:  # joined: the ranks take a command
            self.leader.shutdown_workers()
        for w in self.workers:
            ray.kill(w, no_restart=True)
        try:
            leave_ep_group()
        except Exception as exc:  # a broken group may refuse a clean exit
            log.warning("leaving the EP group: %s", exc)
