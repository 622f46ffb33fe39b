"""Bring-up on Ray: join or start a cluster, and start the HeadActor (and its EP ranks).

Invariants: ``ray.init`` joins ``RAY_ADDRESS`` when set, else starts a local cluster bound to
127.0.0.1 with no dashboard; the head is a named actor (one per name), so every ingress
replica reaches the same engine; arguments cross as plain dicts.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from epserve.cluster.engine_args import EngineArgs, check_model_path

log = logging.getLogger(__name__)

HEAD_NAME = "epserve-head"
NAMESPACE = "epserve"


def init_ray(num_cpus: int | None = None) -> None:
    """Join ``RAY_ADDRESS`` or start a loopback-only local cluster (idempotent)."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=NAMESPACE,
                 log_to_driver=False)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", namespace=NAMESPACE, include_dashboard=False,
             num_cpus=num_cpus, _node_ip_address="127.0.0.1", log_to_driver=False)


def placement_device(device: str) -> str:
    """Where the ranks must be placed: ``auto`` means GPUs when the cluster has any (the driver
    itself may run on a CPU-only head node)."""
    import ray

    if device.startswith("cuda"):
        return "cuda"
    if device == "cpu":
        return "cpu"
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def start_head(args: EngineArgs, name: str = HEAD_NAME, timeout_s: float = 600.0,
               detached: bool = True) -> Any:
    """The named HeadActor for ``args`` (created when absent) once its model is loaded.

    With ``ep_size`` N > 1 a placement group of N bundles (``args.placement_strategy``:
    STRICT_PACK on one node by default, or SPREAD) holds the head in bundle 0 and EP ranks
    1..N-1 in the others."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from epserve.cluster.ep_group import bundle
    from epserve.cluster.head_actor import HeadActor

    args = args.resolved()
    strategy = args.placement_strategy
    # refused here, before Ray or any actor starts, with the loader's own message
    check_model_path(args.model)
    if args.ep_size > 1:
        from epserve.models.config import ModelConfig
        from epserve.models.parallel import ParallelInfo

        experts = ModelConfig.from_pretrained(args.model).num_experts
        ParallelInfo(0, args.ep_size).local_expert_range(experts)
    init_ray()
    opts: dict[str, Any] = dict(name=name, namespace=NAMESPACE, get_if_exists=True,
                                num_cpus=0, max_concurrency=10_000)
    if detached:
        opts["lifetime"] = "detached"
    pg = None
    device_type = placement_device(args.device)
    if args.ep_size == 1 and device_type == "cuda":
        opts["num_gpus"] = 1
    if args.ep_size > 1:
        pg = placement_group([bundle(device_type)] * args.ep_size, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except Exception:
            raise ValueError(f"ep_size={args.ep_size}: the cluster cannot place "
                             f"{args.ep_size} ranks ({bundle(device_type)} each, "
                             f"{strategy})") from None
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)
        if device_type == "cuda":
            opts["num_gpus"] = 1
    head = ray.remote(HeadActor).options(**opts).remote(args.to_dict(), pg)
    ray.get(head.ready.remote(), timeout=timeout_s)
    return head


def stop_head(name: str = HEAD_NAME) -> None:
    """Shut the named head down (and with it its EP ranks), if it exists."""
    import ray

    try:
        head = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return
    try:
        ray.get(head.shutdown.remote(), timeout=30)
    except Exception as exc:  # a dead or stuck head is killed all the same
        log.warning("head shutdown: %s", exc)
    ray.kill(head, no_restart=True)
