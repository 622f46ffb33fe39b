"""EpGroup: the N ranks of one EP engine, seen from the head: rank 0 here, EpWorkers on Ray.

Invariants: ranks 1..N-1 live in bundles 1..N-1 of the head's placement group (bundle 0
holds the head); the rendezvous address and port are picked here and handed to every rank;
an expert count that N does not divide is refused before any actor starts; ``alive`` answers
within its timeout, never hangs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from epserve.cluster.engine_args import EngineArgs
from epserve.cluster.ep_worker import EpWorker

log = logging.getLogger(__name__)


def bundle(device_type: str) -> dict[str, float]:
    """One rank's placement-group bundle."""
    return {"GPU": 1.0, "CPU": 1.0} if device_type == "cuda" else {"CPU": 0.01}


class EpGroup:
    """Brings up ranks 1..N-1 as EpWorker actors and rank 0 (the leader) in this process."""

    def __init__(self, args: EngineArgs, placement_group: Any, init_timeout_s: float = 600.0):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from epserve.models.config import ModelConfig
        from epserve.models.parallel import ParallelInfo
        from epserve.worker.ep_comm import EpComm
        from epserve.worker.ep_dist import free_port, join_ep_group
        from epserve.worker.rank_executor import RankExecutor
        from epserve.worker.channels import EpChannel
        from epserve.worker.step_model import StepModel
        from epserve.worker.runner import Runner, resolve_device

        n = args.ep_size
        cfg = args.runner_config()
        mc = ModelConfig.from_pretrained(cfg.model)
        ParallelInfo(0, n).local_expert_range(mc.num_experts)  # refuses E % N != 0
        device_type = resolve_device(cfg.device).type
        addr = ray.util.get_node_ip_address()
        port = free_port(addr)
        actor = ray.remote(EpWorker)
        self.workers = [actor.options(
            num_cpus=0, num_gpus=1 if device_type == "cuda" else 0, max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=i)).remote(args.to_dict(), i, n)
            for i in range(1, n)]
        refs = [w.init.remote(addr, port) for w in self.workers]
        group, cpu_group = join_ep_group(0, n, addr, port, device_type, args.ep_timeout_s)
        comm = EpComm(0, n, mc.num_experts, group, cpu_group)
        runner = Runner(cfg, ParallelInfo(0, n, comm))
        ray.get(refs, timeout=init_timeout_s)
        for w in self.workers:
            w.start.remote()
        rank0 = RankExecutor(runner, comm, 0, n)
        self.leader = StepModel(rank0, EpChannel(rank0, comm), n,
                                keep_alive_s=args.ep_timeout_s / 4)
        self.world_size = n

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

        if graceful:
            self.leader.shutdown_workers()
        for w in self.workers:
            ray.kill(w, no_restart=True)
        try:
            leave_ep_group()
        except Exception as exc:  # a broken group may refuse a clean exit
            log.warning("leaving the EP group: %s", exc)
