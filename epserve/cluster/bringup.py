"""Bring-up on Ray: join or start a cluster, and start the HeadActor (and its EP ranks).

Invariants: ``ray.init`` joins ``RAY_ADDRESS`` when set, else starts a local cluster bound to
127.0.0.1 with no dashboard; the head is a named actor (one per name), so every ingress
replica reaches the same engine; arguments cross as plain dicts.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from epserve.cluster.engine_args import EngineArgs

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


def start_head(args: EngineArgs, name: str = HEAD_NAME, timeout_s: float = 600.0) -> Any:
    """The named HeadActor for ``args`` (created when absent) once its model is loaded."""
    import ray

    from epserve.cluster.head_actor import HeadActor

    init_ray()
    args = args.resolved()
    if args.ep_size != 1:
        raise ValueError(f"ep_size={args.ep_size}: expert parallelism over several ranks is not "
                         f"available in this version; use ep_size=1")
    actor = ray.remote(HeadActor).options(
        name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_concurrency=10_000)
    head = actor.remote(args.to_dict())
    ray.get(head.ready.remote(), timeout=timeout_s)
    return head


def stop_head(name: str = HEAD_NAME) -> None:
    """Kill the named head (and with it its EP ranks), if it exists."""
    import ray

    try:
        head = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return
    ray.kill(head, no_restart=True)
